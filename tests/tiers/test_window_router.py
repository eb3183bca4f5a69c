"""Tiered cache (QEvict): routing by rank under one byte budget, the write-once ledger, attention
over both tiers, and the errors a user gets for settings that cannot work."""
import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

import vlm_kv
from vlm_kv.api import tiers_with_fields
from vlm_kv.cache.tiered_layer import TieredLayer
from vlm_kv.config import CacheOptions, TierConfig
from vlm_kv.testing import (
    feed_tokens,
    random_tokens,
    record_evictions,
    route_with_forced_decision,
    tiny_gates,
    tiny_inputs,
    tiny_model,
)
from vlm_kv.tiers.entry_router import EntryRouter
from vlm_kv.tiers.int2_tier import Int2Tier, QuantizedWindows, TierShape
from vlm_kv.tiers.window_router import (
    EVICT,
    FP,
    INT2,
    TierRouter,
    WindowRouter,
    reduce_windows,
)

TIERED = ["qevict", "h2o", "snapkv", "tova", "adakv", "pyramidkv", "streaming_llm", "dbtrimkv"]
# 300 decode steps for three scorers (window mass per row, observation window per layer, gates globally);
# the other scorers share the code path and run a shorter stream
LONG = {"qevict", "adakv", "dbtrimkv"}


def _kwargs(policy, model, fp_unit=None, key_grid=None, basis=None):
    """make_cache's keywords: the policy's tier settings with the given ones changed (qevict is tiered
    by itself), snapkv's observation window at 8, the tiny model's gates."""
    fields = {k: v for k, v in (("fp_unit", fp_unit), ("key_grid", key_grid), ("basis", basis)) if v is not None}
    kw = {}
    if fields or policy != "qevict":
        kw["tiers"] = fields or "int2"
    if policy in ("snapkv", "adakv", "pyramidkv"):
        kw["options"] = CacheOptions(scorer_kwargs={"window": 8})
    if policy == "dbtrimkv":
        kw["gates"] = tiny_gates(model)
    return kw


@pytest.mark.parametrize("policy, fp_unit, key_grid, basis",
                         [(p, None, None, None) for p in TIERED] + [(p, "token", None, None) for p in sorted(LONG)]
                         + [("qevict", None, "int8", None), ("dbtrimkv", "token", "int8", None),
                            ("qevict", None, None, "hadamard"), ("dbtrimkv", "token", None, "hadamard")])
def test_held_bytes_stay_within_budget_at_every_routing_event(policy, fp_unit, key_grid, basis):
    model = tiny_model("llama")
    cache = vlm_kv.make_cache(model, policy=policy, budget=0.2, **_kwargs(policy, model, fp_unit, key_grid, basis))
    steps = record_evictions(cache)
    decode = 300 if policy in LONG else 64
    feed_tokens(model, cache, random_tokens(64 + decode, batch=2, vocab=model.config.vocab_size), 64)
    assert len(steps) == 1 + decode // 8  # routing after the prefill and every w = 8 decode steps
    for held, allowed in steps:
        assert held <= allowed
    tiers = cache.stats()["per_tier"]
    assert tiers["int2_windows"] > 0 and tiers["demotions"] >= tiers["int2_windows"]
    per_tier = cache.kv_bytes()["per_tier"]
    assert per_tier["int2"] > 0 and per_tier["scales"] > 0
    assert sum(per_tier.values()) == cache.kv_bytes()["total"]
    if key_grid == "int8":  # the compact grid is what the tier holds and what routing charged
        tier = next(layer.tier for layer in cache.layers if len(layer.tier))
        assert tier.codes.compact and tier.window_bytes() == (tier.codes.code_bytes() + tier.codes.grid_bytes()) // len(tier)


def test_compact_key_grid_holds_more_int2_windows_at_the_same_bytes():
    model = tiny_model("llama")
    tokens = random_tokens(200, vocab=model.config.vocab_size)
    held = {}
    for grid in ("fp16", "int8"):
        cache = vlm_kv.make_cache(model, policy="h2o", budget=0.2, tiers={"key_grid": grid})
        feed_tokens(model, cache, tokens, 184)
        assert cache.kv_bytes()["total"] <= cache.budget_bytes()
        held[grid] = cache.stats()["per_tier"]["int2_windows"]
    assert held["int8"] > held["fp16"]


def test_tiers_hold_more_tokens_than_eviction_alone_at_the_same_bytes():
    model = tiny_model("llama")
    tokens = random_tokens(200, vocab=model.config.vocab_size)
    plain = vlm_kv.make_cache(model, policy="h2o", budget=0.2)
    tiered = vlm_kv.make_cache(model, policy="h2o", budget=0.2, tiers="int2", options=CacheOptions(evict_every=16))
    feed_tokens(model, plain, tokens, 184)
    feed_tokens(model, tiered, tokens, 184)
    assert tiered.kv_bytes()["total"] <= tiered.budget_bytes() == plain.budget_bytes()
    assert tiered.num_entries() > 1.5 * plain.num_entries()


@pytest.mark.parametrize("fp_unit", ["window", "token"])
@pytest.mark.parametrize("policy", ["h2o", "dbtrimkv", "snapkv"])
def test_budget_one_with_tiers_equals_dynamic_cache_and_quantizes_nothing(policy, fp_unit):
    model = tiny_model("llama")
    tokens = random_tokens(40 + 30, batch=2, vocab=model.config.vocab_size)
    ref = feed_tokens(model, DynamicCache(config=model.config), tokens, 40)
    cache = vlm_kv.make_cache(model, policy=policy, budget=1.0, **_kwargs(policy, model, fp_unit))
    out = feed_tokens(model, cache, tokens, 40)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert cache.stats()["per_tier"]["quantized"] == 0


@pytest.mark.parametrize("key_grid, basis", [("fp16", "channel"), ("int8", "channel"), ("int8", "hadamard")])
def test_ledger_reuses_codes_byte_identical_and_quantizes_each_window_once(key_grid, basis):
    model = tiny_model("llama")
    cache = vlm_kv.make_cache(model, policy="h2o", budget=0.5, tiers={"key_grid": key_grid, "basis": basis})
    feed_tokens(model, cache, random_tokens(64, vocab=model.config.vocab_size), 64)
    layer = cache.layers[0]
    tier = layer.tier
    key = (int(tier.row[0]), int(tier.window_id[0]))
    codes = [t.clone() for t in tier.codes.select(torch.tensor([0]))._tensors()]
    quantized = tier.counters.quantized

    def force(decision_of_window):
        route_with_forced_decision(cache, key, decision_of_window)

    def find():
        hit = ((tier.row == key[0]) & (tier.window_id == key[1])).nonzero().flatten()
        return int(hit[0]) if hit.numel() else None

    force(FP)  # promotion: back to FP, the ledger entry stays dormant
    i = find()
    assert i is not None and not bool(tier.active[i])
    positions = layer.store.padded_view().positions[key[0] // 2, key[0] % 2]
    assert ((positions // 8) == key[1]).sum() == 8  # the whole window is FP again
    force(INT2)  # demotion again: codes come from the ledger
    i = find()
    assert bool(tier.active[i])
    again = tier.codes.select(torch.tensor([i]))._tensors()
    for a, b in zip(codes, again):
        assert torch.equal(a, b)
    assert tier.counters.quantized == quantized
    assert tier.counters.ledger_reuses >= 1 and tier.counters.promotions >= 1


# token: INT2 windows with holes where entries are FP; dbtrimkv's gates observe no attention, so its decode
# attends the Hadamard windows with the rotated query (h2o's merged view rotates every entry back)
@pytest.mark.parametrize("policy, fp_unit", [("h2o", "window"), ("h2o", "token"), ("dbtrimkv", "token")])
def test_attention_over_both_tiers_is_one_softmax_over_the_dequantized_entries(policy, fp_unit, monkeypatch):
    model = tiny_model("llama")
    gates = {"gates": tiny_gates(model)} if policy == "dbtrimkv" else {}
    cache = vlm_kv.make_cache(model, policy=policy, budget=0.3, tiers={"fp_unit": fp_unit}, **gates)
    calls = []
    # the in-place decode (the C++ kernel on CPU under "auto", or its PyTorch path)
    in_place = vlm_kv.attention.decode.decode_attention_with_rotated
    monkeypatch.setattr(vlm_kv.attention.decode, "decode_attention_with_rotated", lambda *a: calls.append(1) or in_place(*a))
    in_kernel = vlm_kv.attention.backend.tiered_decode_attention_cpu
    monkeypatch.setattr(vlm_kv.attention.backend, "tiered_decode_attention_cpu", lambda *a: calls.append(1) or in_kernel(*a))
    tokens = random_tokens(2 * 72, batch=2, vocab=model.config.vocab_size)
    mask = torch.ones_like(tokens)
    mask[1, :5] = 0  # batch padding on the left
    with torch.no_grad():
        model(input_ids=tokens[:, :72], attention_mask=mask[:, :72], past_key_values=cache, use_cache=True)
    layer = cache.layers[1]
    assert layer.tier.num_active > 0
    B, H, D = 2, model.config.num_key_value_heads, 16
    hq = model.config.num_attention_heads
    query = torch.randn(B, hq, 1, D)
    store = layer.store
    store.append(torch.randn(B, H, 1, D), torch.randn(B, H, 1, D), layer.seen, torch.zeros(B, 1, dtype=torch.uint8),
                 torch.ones(B, 1, dtype=torch.bool))
    out = cache.attend(1, query, 0.25)  # layer 1's attention, [B, 1, Hq, D]
    fp = store.padded_view()
    keys, values = layer.tier.dequantize(torch.arange(len(layer.tier)))  # out of the Hadamard basis
    assert layer.tier.rotated  # the default basis
    for b in range(B):
        for qh in range(hq):
            h = qh // (hq // H)
            k = [fp.keys[b, h][fp.valid[b, h]]]
            v = [fp.values[b, h][fp.valid[b, h]]]
            mine = layer.tier.active & (layer.tier.row == b * H + h)
            present = layer.tier.positions[mine] >= 0
            k.append(keys[mine][present])
            v.append(values[mine][present])
            k, v = torch.cat(k), torch.cat(v)
            ref = F.scaled_dot_product_attention(query[b, qh, None, None], k[None, None], v[None, None], scale=0.25)
            torch.testing.assert_close(out[b, 0, qh], ref[0, 0, 0], rtol=1e-5, atol=1e-5)
    assert bool(calls) == (policy == "dbtrimkv")


@pytest.mark.parametrize("fp_unit", ["window", "token"])
def test_tiers_with_images_and_a_second_turn_stay_within_budget(fp_unit):
    model = tiny_model("qwen2_5_vl")
    turn1 = tiny_inputs(model, num_images=2, text_len=24, seed=0)
    turn2 = tiny_inputs(model, num_images=1, text_len=16, seed=1)
    cache = vlm_kv.make_cache(model, policy="snapkv", budget=0.3, tiers={"window": 4, "fp_unit": fp_unit},
                              options=CacheOptions(scorer_kwargs={"window": 4}))
    steps = record_evictions(cache)
    with torch.no_grad():
        for turn in (turn1, turn2):
            logits = model(**{k: v for k, v in turn.items() if k != "attention_mask"}, past_key_values=cache,
                           use_cache=True).logits
            tok = logits[:, -1:].argmax(-1)
            for _ in range(12):
                tok = model(input_ids=tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    assert len(steps) >= 6
    for held, allowed in steps:
        assert held <= allowed
    report = cache.kv_bytes()
    assert report["per_modality"]["image"] > 0
    assert cache.stats()["per_tier"]["int2_entries"] > 0
    positions, tier = cache.layers[0].held_positions()
    held = positions[positions >= 0]
    assert held.unique().numel() == held.numel() or positions.shape[1] > 1  # no entry held twice in a row
    assert bool((tier == 1).any())


def test_kivi2_quantizes_everything_but_sinks_and_residual_and_evicts_nothing():
    model = tiny_model("llama")
    tokens = random_tokens(96 + 20, vocab=model.config.vocab_size)
    cache = vlm_kv.make_cache(model, policy="kivi2", budget=1.0, tiers={"window": 8},
                              options=CacheOptions(scorer_kwargs={"residual": 16}))
    feed_tokens(model, cache, tokens, 96)
    assert cache.evicted_entries == 0
    assert cache.num_entries() == cache.get_seq_length() * 2 * model.config.num_key_value_heads
    stats = cache.stats()["per_tier"]
    # sinks window (8) + the residual (>= 16, rounded to whole windows, plus the open window) stay FP
    per_row_fp = stats["fp_entries"] // (2 * model.config.num_key_value_heads)
    assert 8 + 16 <= per_row_fp <= 8 + 16 + 2 * 8
    assert cache.kv_bytes()["total"] < 0.6 * cache.full_kv_bytes()
    with pytest.raises(vlm_kv.config.BudgetError, match="budget=1.0"):
        vlm_kv.make_cache(model, policy="kivi2", budget=0.1)


def test_the_router_strategy_is_chosen_once_from_fp_unit():
    assert isinstance(TierRouter(TierConfig()).strategy, WindowRouter)
    assert isinstance(TierRouter(TierConfig(fp_unit="token")).strategy, EntryRouter)


def test_route_candidates_follows_the_three_rules():
    router = WindowRouter(TierConfig(int2_share=0.5, window=8))
    group = torch.zeros(6, dtype=torch.long)
    score = torch.tensor([6.0, 5, 4, 3, 2, 1])
    cost = torch.full((6,), 100)
    b_q = 25
    # rule 1: everything fits in FP
    assert router._route_candidates(group, score, cost, torch.tensor([600]), b_q, 1).tolist() == [FP] * 6
    # rule 2: 4 FP + 2 INT2 = 450 fits 450, nothing evicted
    assert router._route_candidates(group, score, cost, torch.tensor([450]), b_q, 1).tolist() == [FP] * 4 + [INT2] * 2
    # rule 3: (1 - 0.5) * 140 = 70 -> no FP window; 140 // 25 = 5 INT2, the last evicted
    assert router._route_candidates(group, score, cost, torch.tensor([140]), b_q, 1).tolist() == [INT2] * 5 + [EVICT]
    # ranking is by score, not by order
    shuffled = router._route_candidates(group, score.flip(0), cost, torch.tensor([450]), b_q, 1)
    assert shuffled.tolist() == [INT2] * 2 + [FP] * 4


def _best_split_by_brute_force(values, costs, free, b_q, eps):
    """(n_fp, n_q) of one group: every k of top windows in FP, INT2 for the next ones the rest buys."""
    best = None
    for k in range(len(values)):
        room = free - sum(costs[:k])
        if room < 0:
            break
        n_q = min(room // b_q, len(values) - k)
        worth = sum(values[:k]) + eps * sum(values[k : k + n_q])
        if best is None or worth >= best[0]:
            best = (worth, k, n_q)
    return best[1], best[2]


def test_value_split_keeps_the_mix_of_fp_and_int2_worth_most():
    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        eps = [0.3, 0.5, 0.8][trial % 3]
        router = WindowRouter(TierConfig(window=8, int2_value=eps))
        sizes = [5, 7]
        group = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(sizes)])
        value = torch.rand(group.numel(), generator=gen, dtype=torch.float64) ** 3
        cost = torch.randint(80, 121, (group.numel(),), generator=gen)
        free = torch.randint(30, 500, (2,), generator=gen)
        b_q = 25
        out = router._route_candidates(group, value.log(), cost, free, b_q, 2, value)
        for i in range(2):
            mine = (group == i).nonzero().flatten()
            order = mine[torch.argsort(value[mine], descending=True, stable=True)]
            n_fp, n_q = _best_split_by_brute_force(value[order].tolist(), cost[order].tolist(), int(free[i]), b_q, eps)
            if int(cost[mine].sum()) <= int(free[i]):
                n_fp, n_q = len(mine), 0  # rule 1: all of it fits in FP
            expect = [FP] * n_fp + [INT2] * n_q + [EVICT] * (len(mine) - n_fp - n_q)
            assert out[order].tolist() == expect, (trial, i)


def test_value_split_quantizes_less_when_the_next_windows_are_worth_little():
    router = WindowRouter(TierConfig(window=8, int2_value=0.5))
    group = torch.zeros(8, dtype=torch.long)
    cost = torch.full((8,), 100)
    steep = torch.tensor([8.0, 4, 2, 1, 0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)
    flat = torch.full((8,), 1.0, dtype=torch.float64)
    free = torch.tensor([400])
    steep_out = router._route_candidates(group, steep.log(), cost, free, 25, 1, steep)
    flat_out = router._route_candidates(group, flat.log(), cost, free, 25, 1, flat)
    # steep: 4 FP hold 15 of 15.94, INT2 windows would add less than the FP window they cost;
    # flat: 3 FP + 4 INT2 (worth 5) tie 2 FP + 6 INT2, and ties go to more FP
    assert steep_out.tolist() == [FP] * 4 + [EVICT] * 4
    assert flat_out.tolist() == [FP] * 3 + [INT2] * 4 + [EVICT]


def test_int2_value_routes_within_budget_and_needs_additive_scores():
    model = tiny_model("llama")
    cache = vlm_kv.make_cache(model, policy="dbtrimkv", budget=0.2, tiers={"int2_value": 0.5},
                              gates=tiny_gates(model))
    steps = record_evictions(cache)
    feed_tokens(model, cache, random_tokens(64 + 48, batch=2, vocab=model.config.vocab_size), 64)
    assert steps and all(held <= allowed for held, allowed in steps)
    assert cache.stats()["per_tier"]["int2_windows"] > 0
    with pytest.raises(ValueError, match="additive window scores"):
        vlm_kv.make_cache(model, policy="streaming_llm", budget=0.2, tiers={"int2_value": 0.5})
    with pytest.raises(ValueError, match="int2_value must be in"):
        vlm_kv.make_cache(model, policy="h2o", budget=0.2, tiers={"int2_value": 1.5})
    with pytest.raises(ValueError, match="pass tiers=int2"):
        tiers_with_fields("h2o", None, {"int2_value": 0.5})
    with pytest.raises(ValueError, match="pass one of them"):
        vlm_kv.make_cache(model, policy="h2o", budget=0.2, tiers={"int2_value": 0.5, "int2_share": 0.3})


def test_window_scores_reduce_as_their_scorer_says():
    scores = torch.tensor([1.0, 2.0, float("-inf"), 3.0])
    window = torch.tensor([0, 0, 0, 1])
    assert reduce_windows(scores, window, 2, "sum").tolist() == [3.0, 3.0]
    assert reduce_windows(scores, window, 2, "max").tolist() == [2.0, 3.0]
    lse = reduce_windows(scores, window, 2, "logsumexp")
    assert abs(float(lse[0]) - float(torch.logsumexp(torch.tensor([1.0, 2.0]), 0))) < 1e-6


def test_quantized_windows_round_trip_their_grid():
    keys, values = torch.randn(3, 8, 16), torch.randn(3, 8, 16)
    q = QuantizedWindows.quantize(keys, values, "fp16")
    k, v = q.dequantize(torch.float32)
    assert (k - keys).abs().le(q.key_scale.float()[:, None, :] / 2 + 1e-6).all()
    assert (v - values).abs().le(q.value_scale.float()[:, :, None] / 2 + 1e-6).all()
    assert q.code_bytes() == 2 * 3 * 8 * 4 and q.grid_bytes() == 3 * (2 * 2 * 16 + 2 * 2 * 8)
    c = QuantizedWindows.quantize(keys, values, "int8")
    scale, _ = c.key_grid()
    k8, v8 = c.dequantize(torch.float32)
    assert c.compact and (k8 - keys).abs().le(scale[:, None, :] / 2 + 1e-6).all() and torch.equal(v8, v)
    assert c.grid_bytes() == 3 * (2 * 16 + 6 + 2 * 2 * 8)
    assert torch.equal(c.select(torch.tensor([2, 0])).key_grid()[1], c.key_grid()[1][[2, 0]])


def test_a_hadamard_tier_stores_rotated_codes_and_gives_back_the_entries():
    from vlm_kv.kernels.int2 import hadamard_basis

    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(3, 8, 16, generator=gen) * torch.linspace(0.2, 6, 16)
    values = torch.randn(3, 8, 16, generator=gen)
    values[..., 3] += 12.0  # an outlier channel stretches each token's grid
    tier = Int2Tier(TierShape(1, 3, 16, torch.float32, torch.device("cpu")),
                    TierConfig(window=8, key_grid="fp16", basis="hadamard"))
    h = hadamard_basis(16)
    codes = tier.quantize(keys, values)
    rotated = QuantizedWindows.quantize(keys @ h, values @ h, tier.key_grid)
    for a, b in zip(codes._tensors(), rotated._tensors()):  # the codes of the rotated windows, same bytes
        assert torch.equal(a, b)
    tier.codes, tier.positions = codes, torch.arange(24, dtype=torch.int32).view(3, 8)
    k, v = tier.dequantize(torch.arange(3))
    kr, vr = rotated.dequantize(torch.float32)
    torch.testing.assert_close(k, kr @ h, rtol=0, atol=1e-5)
    torch.testing.assert_close(v, vr @ h, rtol=0, atol=1e-5)
    plain = QuantizedWindows.quantize(keys, values, tier.key_grid).dequantize(torch.float32)[1]
    assert (v - values).pow(2).mean() < (plain - values).pow(2).mean()


@pytest.mark.parametrize("kwargs, match", [
    ({"policy": "h2o", "tiers": {"int2_share": 1.0}}, "int2_share"),
    ({"policy": "h2o", "tiers": {"int2_share": -0.1}}, "int2_share"),
    ({"policy": "h2o", "tiers": {"window": 0}}, "window"),
    ({"policy": "fastv", "tiers": "int2"}, "cannot route windows"),
    ({"policy": "dbtrimkv_threshold", "tiers": "int2"}, "cannot route windows"),
    ({"policy": "h2o", "tiers": "int4"}, "tiers must be"),
    ({"policy": "qevict", "tiers": "none"}, "tiered cache"),
    ({"policy": "h2o", "tiers": {"fp_unit": "page"}}, "fp_unit"),
    ({"policy": "dbtrimkv", "tiers": {"fp_unit": "token", "int2_value": 0.7}}, "fp_unit='token'"),
    ({"policy": "kivi2", "budget": 1.0, "tiers": {"fp_unit": "token"}}, "fp_unit='token'"),
    ({"policy": "h2o", "tiers": {"key_grid": "int4"}}, "key_grid"),
    ({"policy": "h2o", "tiers": {"basis": "pca"}}, "basis must be one of"),
])
def test_bad_tier_settings_are_refused_clearly(kwargs, match):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=match):
        vlm_kv.make_cache(model, **{"budget": 0.2, **kwargs})


@pytest.mark.parametrize("fields", [{"window": 8}, {"fp_unit": "token"}, {"key_grid": "int8"}, {"basis": "hadamard"}])
def test_tier_settings_without_a_tier_are_refused(fields):
    """Flat settings (model arguments, grid cells) that configure a tier nobody asked for."""
    with pytest.raises(ValueError, match=f"{next(iter(fields))}=.*pass tiers=int2"):
        tiers_with_fields("h2o", None, fields)


def test_chunked_prefill_routes_after_every_chunk_within_budget():
    model = tiny_model("llama")
    tokens = random_tokens(96 + 8, vocab=model.config.vocab_size)
    cache = vlm_kv.make_cache(model, policy="qevict", budget=0.25, options=CacheOptions(prefill_chunk=32))
    steps = record_evictions(cache)
    feed_tokens(model, cache, tokens, 96)
    assert cache.chunked_prefills == 1 and len(steps) == 3 + 1  # three chunks, then one decode event
    assert all(held <= allowed for held, allowed in steps)
    full = feed_tokens(model, DynamicCache(config=model.config), tokens, 96)
    whole = vlm_kv.make_cache(model, policy="qevict", budget=1.0, options=CacheOptions(prefill_chunk=32))
    torch.testing.assert_close(feed_tokens(model, whole, tokens, 96)[:, -8:], full[:, -8:], rtol=1e-5, atol=1e-5)


def test_decode_with_the_rotated_query_equals_rotating_every_int2_entry_back(monkeypatch):
    """The torch decode path attends Hadamard windows with q @ H (no per-entry rotation), reading both
    tiers where they lie: the same logits as the merged, padded view with every entry rotated back."""
    model = tiny_model("llama")
    tokens = random_tokens(64 + 24, vocab=model.config.vocab_size)
    torch_path = CacheOptions(attention_backend="torch")  # the PyTorch path (the C++ kernel: tests/kernels)
    calls = []
    in_place = vlm_kv.attention.decode.decode_attention_with_rotated

    def counted(*args, **kwargs):
        calls.append(1)
        return in_place(*args, **kwargs)

    monkeypatch.setattr(vlm_kv.attention.decode, "decode_attention_with_rotated", counted)
    cache = vlm_kv.make_cache(model, policy="dbtrimkv", budget=0.3, tiers="int2", gates=tiny_gates(model),
                              options=torch_path)
    fast = feed_tokens(model, cache, tokens, 64)
    assert calls and cache.layers[0].tier.rotated and cache.stats()["per_tier"]["int2_windows"] > 0
    # the reference: the same windows, every entry rotated back and attended in the merged view
    monkeypatch.setattr(TieredLayer, "_decodes_in_place", lambda self, query, scorer: False)
    cache = vlm_kv.make_cache(model, policy="dbtrimkv", budget=0.3, tiers="int2", gates=tiny_gates(model),
                              options=torch_path)
    n = len(calls)
    slow = feed_tokens(model, cache, tokens, 64)
    assert len(calls) == n
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("policy, fp_unit", [("h2o", "window"), ("dbtrimkv", "token")])
def test_the_ledger_keeps_its_active_windows_first_in_layout_order(policy, fp_unit):
    model = tiny_model("llama")
    cache = vlm_kv.make_cache(model, policy=policy, budget=0.3, **_kwargs(policy, model, fp_unit))
    feed_tokens(model, cache, random_tokens(64 + 40, batch=2, vocab=model.config.vocab_size), 64)
    for layer in cache.layers:
        tier = layer.tier
        n = tier.num_active
        assert n > 1
        assert bool(tier.active[:n].all()) and not bool(tier.active[n:].any())
        key = tier.row[:n] * (int(tier.window_id.max()) + 1) + tier.window_id[:n]
        assert bool((key[1:] > key[:-1]).all())  # by row (sequence, then KV head), then window id
        assert tier._layout().prefix


def test_rotated_entries_of_an_out_of_order_ledger_are_the_same():
    """The slices a decode step reads rely on the ledger's order; a ledger out of that order (never
    left so by routing) is read through its layout's gathers and gives the same entries."""
    model = tiny_model("llama")
    cache = vlm_kv.make_cache(model, policy="dbtrimkv", budget=0.3, **_kwargs("dbtrimkv", model, "token"))
    feed_tokens(model, cache, random_tokens(64 + 20, batch=2, vocab=model.config.vocab_size), 64)
    tier = cache.layers[0].tier
    want = tier.rotated_entries()
    tier._take(torch.arange(len(tier) - 1, -1, -1))  # reversed
    assert not tier._layout().prefix
    got = tier.rotated_entries()
    for a, b in zip(want, got):
        assert a.head_counts == b.head_counts
        for name in ("keys", "value_codes", "value_scale", "value_zero"):
            assert torch.equal(getattr(a, name), getattr(b, name))
        assert (a.holes is None) == (b.holes is None)
        if a.holes is not None:
            assert torch.equal(a.holes, b.holes)


@pytest.mark.parametrize("policy, scorer_class, fp_unit", [("dbtrimkv", "RetentionScorer", "token"),
                                                            ("qevict", "H2O", None)])
def test_routing_by_state_scores_without_int2_keys_or_sorting_and_decides_the_same(policy, scorer_class, fp_unit,
                                                                                   monkeypatch):
    """A scorer of single entries by state and positions: its routing events dequantize no INT2
    key and do not sort rows by position, and decide exactly as with both."""
    import vlm_kv.policies.h2o as h2o
    import vlm_kv.policies.retention as retention
    import vlm_kv.tiers.window_router as router

    cls = {"RetentionScorer": retention.RetentionScorer, "H2O": h2o.H2O}[scorer_class]
    model = tiny_model("llama")
    tokens = random_tokens(64 + 40, batch=2, vocab=model.config.vocab_size)
    original_view, original_merge = Int2Tier.view, router.merge_views

    def run(shortcuts):
        monkeypatch.setattr(cls, "score_reads_keys", not shortcuts)
        monkeypatch.setattr(cls, "score_is_per_entry", shortcuts)
        keyed, sorted_ = [], []

        def view(self, *args, **kwargs):
            keyed.append(kwargs.get("with_keys", True))
            return original_view(self, *args, **kwargs)

        def merge(fp, tier, sort):
            sorted_.append(sort)
            return original_merge(fp, tier, sort)

        monkeypatch.setattr(Int2Tier, "view", view)
        monkeypatch.setattr(router, "merge_views", merge)
        cache = vlm_kv.make_cache(model, policy=policy, budget=0.3, **_kwargs(policy, model, fp_unit))
        out = feed_tokens(model, cache, tokens, 64)
        held = [layer.held_positions() for layer in cache.layers]
        return out, held, keyed, sorted_

    out_a, held_a, keyed_a, sorted_a = run(True)
    out_b, held_b, keyed_b, sorted_b = run(False)
    assert False in keyed_a and False not in keyed_b  # routing events scored without INT2 keys
    assert sorted_a and not any(sorted_a) and all(sorted_b)  # ... and without sorting rows
    torch.testing.assert_close(out_a, out_b, rtol=0, atol=0)
    for (pa, ta), (pb, tb) in zip(held_a, held_b):
        assert torch.equal(pa, pb) and torch.equal(ta, tb)


def test_a_tier_view_without_keys_carries_no_values():
    model = tiny_model("llama")
    cache = vlm_kv.make_cache(model, policy="h2o", budget=0.3, tiers="int2")
    feed_tokens(model, cache, random_tokens(64, vocab=model.config.vocab_size), 64)
    tier = cache.layers[0].tier
    with pytest.raises(ValueError, match="with_values=False"):
        tier.view(with_keys=False, with_values=True)
    view = tier.view(with_keys=False, with_values=False).view
    assert view.keys.shape[-1] == 0 and view.keys.shape[:3] == view.positions.shape


def test_packed_windows_are_kept_between_routing_events_and_dropped_at_one():
    model = tiny_model("llama")
    cache = vlm_kv.make_cache(model, policy="dbtrimkv", budget=0.3, **_kwargs("dbtrimkv", model, "token"))
    tokens = random_tokens(64 + 9, batch=2, vocab=model.config.vocab_size)
    feed_tokens(model, cache, tokens, 64)
    tier = cache.layers[0].tier
    first = tier.packed_windows()
    assert tier.packed_windows() is first  # no rebuild since: the same views
    tier.rebuild(torch.ones(len(tier), dtype=torch.bool), tier.active.clone(), None, None)
    assert tier._packed_cache is None  # nothing holds views of the replaced codes
    again = tier.packed_windows()
    assert again is not first
    assert torch.equal(again[0].key_codes, first[0].key_codes)
