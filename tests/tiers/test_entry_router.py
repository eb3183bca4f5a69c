"""Token-granular FP routing (``fp_unit="token"``): FP entries chosen one by one, INT2 windows
with holes, the write-once ledger per slot, and the byte charges."""
import pytest
import torch

import vlm_kv
from vlm_kv.config import CacheOptions, TierConfig
from vlm_kv.testing import (
    feed_tokens,
    random_tokens,
    record_evictions,
    tiny_gates,
    tiny_model,
)
from vlm_kv.tiers.entry_router import EntryRouter
from vlm_kv.tiers.windows import FP, INT2


def _rows(layer):
    """Per (batch, kv head) row: FP positions and attended INT2 positions of one layer."""
    fp = layer.store.padded_view()
    tier = layer.tier
    B, H = fp.positions.shape[:2]
    out = []
    for b in range(B):
        for h in range(H):
            fp_pos = fp.positions[b, h][fp.valid[b, h]].tolist()
            mine = tier.active & (tier.row == b * H + h)
            q_pos = tier.positions[mine]
            out.append((fp_pos, q_pos[q_pos >= 0].tolist(), tier.window_id[tier.row == b * H + h].tolist()))
    return out


@pytest.mark.parametrize("policy", ["h2o", "dbtrimkv"])
def test_int2_windows_have_holes_where_entries_are_fp_and_no_entry_is_held_twice(policy):
    model = tiny_model("llama")
    kw = {"gates": tiny_gates(model)} if policy == "dbtrimkv" else {}
    cache = vlm_kv.make_cache(model, policy=policy, budget=0.2, tiers={"fp_unit": "token", "int2_share": 0.5}, **kw)
    feed_tokens(model, cache, random_tokens(96 + 40, batch=2, vocab=model.config.vocab_size), 96)
    holes = 0
    for layer in cache.layers:
        for fp_pos, q_pos, windows in _rows(layer):
            assert not set(fp_pos) & set(q_pos)  # an entry is attended from one tier only
            assert len(set(q_pos)) == len(q_pos)
            ledgered = set(windows)
            # an FP entry in a ledgered window is a hole of that window (its codes stay for a later demotion)
            holes += sum(1 for p in fp_pos if p // 8 in ledgered)
    assert holes > 0
    assert cache.stats()["per_tier"]["int2_entries"] > 0


def _force_entry(cache, row: int, position: int, decision: int) -> None:
    """One routing event in which the entry at ``position`` of layer 0, row ``row`` gets ``decision``."""
    router = cache.router
    assert isinstance(router.strategy, EntryRouter)
    decide = router._decide

    def patched(layers, routings, allocation, scorer):
        decisions, fallback = decide(layers, routings, allocation, scorer)
        H = decisions[0].shape[1]
        r = routings[0]
        hit = (r.positions[row // H, row % H] == position) & r.valid[row // H, row % H]
        assert int(hit.sum()) == 1
        decisions[0][row // H, row % H][hit] = decision
        return decisions, fallback

    router._decide = patched  # this instance only; the class's method comes back below
    try:
        cache.evict()
    finally:
        del router._decide


def test_one_entry_moves_between_tiers_through_the_same_codes():
    model = tiny_model("llama")
    cache = vlm_kv.make_cache(model, policy="h2o", budget=0.5, tiers={"fp_unit": "token"})
    feed_tokens(model, cache, random_tokens(64, vocab=model.config.vocab_size), 64)
    tier = cache.layers[0].tier
    i = int(torch.nonzero(tier.active).flatten()[0])
    row, wid = int(tier.row[i]), int(tier.window_id[i])
    slot = int(torch.nonzero(tier.positions[i] >= 0).flatten()[0])
    position = int(tier.positions[i, slot])
    codes = [t.clone() for t in tier.codes.select(torch.tensor([i]))._tensors()]
    quantized = tier.counters.quantized

    def window():
        hit = ((tier.row == row) & (tier.window_id == wid)).nonzero().flatten()
        assert hit.numel() == 1  # the window stays in the ledger while one of its entries lives
        return int(hit[0])

    _force_entry(cache, row, position, FP)  # promoted alone
    j = window()
    assert int(tier.positions[j, slot]) == -1
    fp = cache.layers[0].store.padded_view()
    H = fp.positions.shape[1]
    assert position in fp.positions[row // H, row % H][fp.valid[row // H, row % H]].tolist()
    _force_entry(cache, row, position, INT2)  # demoted again: the stored codes, not new ones
    j = window()
    assert int(tier.positions[j, slot]) == position
    for a, b in zip(codes, tier.codes.select(torch.tensor([j]))._tensors()):
        assert torch.equal(a, b)
    assert tier.counters.quantized == quantized
    assert tier.counters.ledger_reuses >= 1 and tier.counters.promotions >= 1


def test_no_int2_share_holds_full_precision_entries_only():
    model = tiny_model("llama")
    cache = vlm_kv.make_cache(model, policy="h2o", budget=0.25, tiers={"fp_unit": "token", "int2_share": 0.0})
    steps = record_evictions(cache)
    feed_tokens(model, cache, random_tokens(96 + 24, vocab=model.config.vocab_size), 96)
    assert cache.stats()["per_tier"]["quantized"] == 0
    assert all(held <= allowed for held, allowed in steps)
    # FP is chosen per entry: the rows do not hold whole windows only
    partial = 0
    for fp_pos, _, _ in _rows(cache.layers[0]):
        counts = torch.bincount(torch.tensor(fp_pos) // 8)
        partial += int(((counts > 0) & (counts < 8)).sum())
    assert partial > 0


def test_token_routing_holds_more_fp_bytes_than_window_routing_leaves_unused():
    """Both routers spend the same bytes; the entry router fills them to within one entry and
    one window per group (the window router to within one FP window)."""
    model = tiny_model("llama")
    tokens = random_tokens(128 + 16, batch=2, vocab=model.config.vocab_size)
    for fp_unit in ("window", "token"):
        cache = vlm_kv.make_cache(model, policy="h2o", budget=0.2, tiers={"fp_unit": fp_unit})
        steps = record_evictions(cache)
        feed_tokens(model, cache, tokens, 128)
        assert all(held <= allowed for held, allowed in steps)
        if fp_unit == "token":
            per_entry = cache.layers[0].store.bytes_per_entry
            b_q = cache.layers[0].tier.window_bytes()
            rows = len(cache.layers) * 2 * model.config.num_key_value_heads
            held, allowed = steps[0]
            assert allowed - held <= rows * (per_entry + b_q)


def test_chunked_prefill_and_a_second_turn_route_by_entries_within_budget():
    model = tiny_model("llama")
    cache = vlm_kv.make_cache(model, policy="dbtrimkv", budget=0.25, tiers={"fp_unit": "token"},
                              gates=tiny_gates(model), options=CacheOptions(prefill_chunk=32))
    steps = record_evictions(cache)
    feed_tokens(model, cache, random_tokens(96 + 16, vocab=model.config.vocab_size), 96)
    feed_tokens(model, cache, random_tokens(40 + 8, vocab=model.config.vocab_size, seed=3), 40)
    assert cache.chunked_prefills >= 1 and len(steps) >= 5
    assert all(held <= allowed for held, allowed in steps)
    assert cache.stats()["per_tier"]["int2_entries"] > 0


@pytest.mark.parametrize("spill, key_rope", [(True, "post"), (True, "pre"), (False, "post")])
def test_a_promoted_entry_is_its_original_only_with_spill(spill, key_rope):
    model = tiny_model("llama")
    tokens = random_tokens(64, vocab=model.config.vocab_size)
    ref = vlm_kv.make_cache(model, policy="full", budget=1.0)
    with torch.no_grad():
        model(input_ids=tokens, past_key_values=ref, use_cache=True)
    cache = vlm_kv.make_cache(model, policy="h2o", budget=0.5,
                              tiers={"fp_unit": "token", "spill": spill, "key_rope": key_rope})
    feed_tokens(model, cache, tokens, 64)
    tier = cache.layers[0].tier
    i = int(torch.nonzero(tier.active).flatten()[0])
    row = int(tier.row[i])
    position = int(tier.positions[i][tier.positions[i] >= 0][0])
    _force_entry(cache, row, position, FP)
    fp = cache.layers[0].store.padded_view(with_values=True)
    H = fp.positions.shape[1]
    at = (fp.positions[row // H, row % H] == position) & fp.valid[row // H, row % H]
    key, value = fp.keys[row // H, row % H][at][0], fp.values[row // H, row % H][at][0]
    ref_k, ref_v = ref.layers[0].keys[row // H, row % H, position], ref.layers[0].values[row // H, row % H, position]
    assert torch.equal(key, ref_k) == spill and torch.equal(value, ref_v) == spill
    if not spill:
        torch.testing.assert_close(key, ref_k, rtol=0, atol=float(ref_k.abs().max()))  # lossy, same entry


def test_fp_unit_cli_option_reaches_the_cache_and_needs_tiers():
    import argparse

    from vlm_kv.arguments.tier_flags import add_tier_args, tier_kwargs

    p = argparse.ArgumentParser()
    add_tier_args(p)
    kw = tier_kwargs(p.parse_args(["--tiers", "int2", "--fp-unit", "token"]))
    assert kw == {"tiers": {"fp_unit": "token"}}
    assert vlm_kv.make_cache(tiny_model("llama"), policy="h2o", budget=0.2, **kw).tiers.fp_unit == "token"
    with pytest.raises(ValueError, match="--fp-unit"):
        tier_kwargs(p.parse_args(["--fp-unit", "token"]))


def test_dbtrimkv_tiers_choose_fp_by_entries_by_default_and_other_policies_by_windows():
    model = tiny_model("llama")
    gates = tiny_gates(model)
    tiers = vlm_kv.make_cache(model, policy="dbtrimkv", budget=0.2, tiers="int2", gates=gates).tiers
    assert (tiers.fp_unit, tiers.int2_share_by_budget) == ("token", (0.1, 0.5, 0.25, 0.3))
    share = tiers.share_for(torch.tensor([0.05, 0.1, 0.175, 0.25, 0.5], dtype=torch.float64))
    torch.testing.assert_close(share, torch.tensor([0.5, 0.5, 0.4, 0.3, 0.3], dtype=torch.float64))
    # what the caller says wins; the value split routes whole windows
    window = vlm_kv.make_cache(model, policy="dbtrimkv", budget=0.2, tiers={"fp_unit": "window"}, gates=gates).tiers
    assert (window.fp_unit, window.int2_share_by_budget, window.int2_share) == ("window", None, 0.7)
    fixed = vlm_kv.make_cache(model, policy="dbtrimkv", budget=0.2, tiers={"int2_share": 0.6}, gates=gates).tiers
    assert (fixed.fp_unit, fixed.int2_share_by_budget, fixed.int2_share) == ("token", None, 0.6)
    valued = vlm_kv.make_cache(model, policy="dbtrimkv", budget=0.2, tiers={"int2_value": 0.7}, gates=gates).tiers
    assert (valued.fp_unit, valued.int2_value, valued.int2_share_by_budget) == ("window", 0.7, None)
    plain = vlm_kv.make_cache(model, policy="h2o", budget=0.2, tiers="int2").tiers
    assert (plain.fp_unit, plain.int2_share) == ("window", 0.7)
    qevict = vlm_kv.make_cache(model, policy="qevict", budget=0.2).tiers
    assert (qevict.fp_unit, qevict.key_grid, qevict.int2_share) == ("window", "int8", 0.9)
    paper = vlm_kv.make_cache(model, policy="qevict", budget=0.2,
                              tiers={"key_grid": "fp16", "int2_share": 0.7, "basis": "channel"}).tiers
    assert (paper.key_grid, paper.int2_share, paper.basis) == ("fp16", 0.7, "channel")
    # the compact key grid and the Hadamard basis are every tiered cache's default but KIVI-2's, which
    # keeps KIVI's fp16 grid in the channel basis
    assert (plain.key_grid, tiers.key_grid, qevict.key_grid) == ("int8", "int8", "int8")
    assert (plain.basis, tiers.basis, qevict.basis) == ("hadamard", "hadamard", "hadamard")
    kivi = vlm_kv.make_cache(model, policy="kivi2", budget=1.0).tiers
    assert (kivi.key_grid, kivi.basis) == ("fp16", "channel")


def test_the_int2_share_follows_the_budget_fraction_of_each_sequence(monkeypatch):
    """With a schedule, a generous budget quantizes a smaller share of its bytes than a tight one."""
    model = tiny_model("llama")
    shares = []
    share_for = TierConfig.share_for

    def spy(config, fraction):  # the entry router asks its config for each sequence's share
        share = share_for(config, fraction)
        shares.append(share.clone())
        return share

    monkeypatch.setattr(TierConfig, "share_for", spy)
    tokens = random_tokens(128, vocab=model.config.vocab_size)
    held = {}
    for budget in (0.1, 0.4):
        cache = vlm_kv.make_cache(model, policy="h2o", budget=budget,
                                  tiers={"fp_unit": "token", "int2_share_by_budget": (0.1, 0.8, 0.4, 0.2)})
        feed_tokens(model, cache, tokens, 128)
        held[budget] = cache.kv_bytes()["per_tier"]
    assert abs(float(shares[0][0]) - 0.8) < 0.05 and abs(float(shares[-1][0]) - 0.2) < 0.05
    int2_share = {b: (t["int2"] + t["scales"]) / (t["fp"] + t["int2"] + t["scales"]) for b, t in held.items()}
    assert int2_share[0.4] < int2_share[0.1]


@pytest.mark.parametrize("bad", [(0.1, 0.5, 0.05, 0.3), (0.1, 1.0, 0.25, 0.3), (0.1, 0.5, 0.25)])
def test_bad_share_schedules_are_refused(bad):
    with pytest.raises(ValueError, match="int2_share_by_budget"):
        TierConfig(fp_unit="token", int2_share_by_budget=bad)
    with pytest.raises(ValueError, match="fp_unit='token'"):
        TierConfig(int2_share_by_budget=(0.1, 0.5, 0.25, 0.3))
    with pytest.raises(ValueError, match="int2_share= and int2_share_by_budget= .*pass one of them"):
        vlm_kv.make_cache(tiny_model("llama"), policy="h2o", budget=0.2,
                          tiers={"fp_unit": "token", "int2_share": 0.5, "int2_share_by_budget": (0.1, 0.5, 0.25, 0.3)})


def test_an_event_quantizes_every_layers_fresh_windows_in_one_call_with_the_same_codes(monkeypatch):
    from vlm_kv.tiers.int2_tier import Int2Tier

    model = tiny_model("llama")
    gates = tiny_gates(model)
    tokens = random_tokens(96 + 24, batch=2, vocab=model.config.vocab_size)
    calls = []
    quantize = Int2Tier.quantize

    def counted(self, keys, values):
        calls.append(keys.shape[0])
        return quantize(self, keys, values)

    monkeypatch.setattr(Int2Tier, "quantize", counted)

    def run(per_layer: bool):
        cache = vlm_kv.make_cache(model, policy="dbtrimkv", budget=0.2, gates=gates,
                                  tiers={"fp_unit": "token", "int2_share": 0.5})
        if per_layer:  # the same event, one layer at a time
            strategy = cache.router.strategy
            cache.router.strategy.apply_all = lambda layers, routings, decisions, fallback: [
                EntryRouter.apply_all(strategy, [l], [r], [d], [f]) for l, r, d, f in zip(layers, routings, decisions, fallback)]
        calls.clear()
        logits = feed_tokens(model, cache, tokens, 96)
        return cache, logits, list(calls)

    alone, logits_alone, calls_alone = run(per_layer=True)
    together, logits_together, calls_together = run(per_layer=False)
    assert len(together.layers) > 1
    # fewer, larger calls: the decode events' windows of every layer went in together
    assert len(calls_together) < len(calls_alone)
    assert sum(calls_together) == sum(calls_alone) > 0
    for a, b in zip(alone.layers, together.layers):
        for name in ("key_codes", "key_scale", "key_zero", "value_codes", "value_scale", "value_zero", "key_ref"):
            assert torch.equal(getattr(a.tier.codes, name), getattr(b.tier.codes, name))
        assert torch.equal(a.tier.positions, b.tier.positions) and torch.equal(a.tier.active, b.tier.active)
        assert torch.equal(a.store.body_keys, b.store.body_keys)
        assert a.tier.counters == b.tier.counters
    torch.testing.assert_close(logits_together, logits_alone, rtol=0, atol=0)
