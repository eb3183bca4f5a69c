"""Learned-gate eviction inside the cache: global top-k, per-head top-M, modality floors/caps."""
import pytest
import torch

import vlm_kv
from vlm_kv.gates.io import load_gates, save_gates
from vlm_kv.gates.retention_gate import GateConfig, RetentionGates, retention_scores
from vlm_kv.models.adapters import get_adapter
from vlm_kv.testing import tiny_inputs, tiny_model


def _gates(model, kind="dbtrimkv", coupled=True, seed=0):
    a = get_adapter(model)
    torch.manual_seed(seed)
    g = RetentionGates(GateConfig(kind=kind, hidden_size=a.hidden_size, num_layers=a.num_layers,
                                  num_kv_heads=a.num_kv_heads, width=16, init_bias=1.0, coupled=coupled,
                                  model=a.fingerprint()))
    for p in g.parameters():  # spread the rates so eviction has real choices to make
        torch.nn.init.normal_(p, std=1.0)
    return g


def _record_log_betas(cache):
    seen = {}
    store = cache.store_log_beta

    def recording(layer_idx, log_beta):
        seen.setdefault(layer_idx, []).append(log_beta.clone())
        store(layer_idx, log_beta)

    cache.store_log_beta = recording
    return seen


def _all_scores(cache, seen):
    """Score of every token ever written, per layer: [B, H, T], at the cache's current step."""
    t = cache.get_seq_length()
    out = []
    for layer in range(cache.num_layers):
        lb = torch.cat(seen[layer], dim=-1)
        out.append(retention_scores(lb, torch.arange(lb.shape[-1]), t))
    return out


def test_dbtrimkv_keeps_exactly_the_global_top_k():
    model = tiny_model("llama", num_layers=3)
    cache = vlm_kv.make_cache(model, policy="dbtrimkv", budget=0.25, gates=_gates(model),
                              options=vlm_kv.CacheOptions(scorer_kwargs={"num_sinks": 0}))
    seen = _record_log_betas(cache)
    with torch.no_grad():
        model(input_ids=torch.randint(5, 200, (1, 64), generator=torch.Generator().manual_seed(0)), past_key_values=cache)
    scores = _all_scores(cache, seen)
    kept_scores, evicted_scores = [], []
    lengths = []
    for layer, s in zip(cache.layers, scores):
        view = layer.store.padded_view()
        for h in range(s.shape[1]):
            pos = view.positions[0, h][view.valid[0, h]]
            mask = torch.zeros(64, dtype=torch.bool)
            mask[pos] = True
            kept_scores.append(s[0, h][mask])
            evicted_scores.append(s[0, h][~mask])
            lengths.append(int(mask.sum()))
    kept, evicted = torch.cat(kept_scores), torch.cat(evicted_scores)
    assert kept.numel() == 3 * 2 * 16  # layers x KV heads x (0.25 * 64)
    assert float(kept.min()) >= float(evicted.max())
    assert len(set(lengths)) > 1  # heads end up with different lengths


def test_trimkv_keeps_top_m_per_head():
    model = tiny_model("llama")
    cache = vlm_kv.make_cache(model, policy="trimkv", budget=8, gates=_gates(model, kind="trimkv"),
                              options=vlm_kv.CacheOptions(scorer_kwargs={"num_sinks": 0}))
    seen = _record_log_betas(cache)
    with torch.no_grad():
        model(input_ids=torch.randint(5, 200, (1, 40)), past_key_values=cache)
    for layer, s in zip(cache.layers, _all_scores(cache, seen)):
        view = layer.store.padded_view()
        for h in range(s.shape[1]):
            pos = view.positions[0, h][view.valid[0, h]]
            assert set(pos.tolist()) == set(s[0, h].topk(8).indices.tolist())


def test_gated_policies_keep_the_attention_sinks_by_default():
    model = tiny_model("llama", num_layers=3)
    cache = vlm_kv.make_cache(model, policy="dbtrimkv", budget=0.1, gates=_gates(model))
    with torch.no_grad():
        model(input_ids=torch.randint(5, 200, (1, 200)), past_key_values=cache)
    for layer in cache.layers:
        view = layer.store.padded_view()
        for h in range(view.positions.shape[1]):
            kept = set(view.positions[0, h][view.valid[0, h]].tolist())
            assert {0, 1, 2, 3} <= kept


def test_modality_floor_and_cap_hold_with_images():
    model = tiny_model("qwen2_5_vl")
    inputs = tiny_inputs(model, num_images=2, text_len=20)
    n_image = int((get_adapter(model).modality_of(inputs["input_ids"]) == 1).sum())
    for kwargs, check in (
        ({"modality_floor": {"image": 0.6}}, lambda img, tot: img >= int(0.6 * tot)),
        ({"modality_cap": {"image": 0.1}}, lambda img, tot: img <= int(0.1 * tot)),
    ):
        cache = vlm_kv.make_cache(model, policy="dbtrimkv", budget=0.3, gates=_gates(model),
                                  options=vlm_kv.CacheOptions(allocation_kwargs=kwargs))
        with torch.no_grad():
            model(**inputs, past_key_values=cache)
        stats = cache.stats()
        total = stats["entries"]
        assert 0 < n_image and total == int(0.3 * inputs["input_ids"].shape[1]) * 2 * 2
        assert check(stats["per_modality"]["image"], total), (kwargs, stats["per_modality"])
        assert cache.kv_bytes()["per_modality"]["image"] == stats["per_modality"]["image"] * 2 * 16 * 4


def test_gates_round_trip_and_coupling_shares_the_last_projection(tmp_path):
    model = tiny_model("llama")
    g = _gates(model)
    save_gates(g, str(tmp_path))
    back = load_gates(str(tmp_path), fingerprint=get_adapter(model).fingerprint())
    h = torch.randn(1, 5, get_adapter(model).hidden_size)
    for layer in range(2):
        torch.testing.assert_close(back.log_beta(layer, h), g.log_beta(layer, h))
    names = {n for n, _ in g.named_parameters()}
    assert "head.weight" in names and "bias" in names  # one shared output layer
    uncoupled = _gates(model, coupled=False)
    assert any(n.startswith("heads.1") for n, _ in uncoupled.named_parameters())
    assert (torch.cat([p.flatten() for p in g.parameters()]).numel()
            < torch.cat([p.flatten() for p in uncoupled.parameters()]).numel())


def test_gated_generate_with_images_holds_the_budget():
    model = tiny_model("qwen2_5_vl")
    inputs = tiny_inputs(model, batch_size=2, num_images=2, left_pad=2)
    cache = vlm_kv.make_cache(model, policy="dbtrimkv", budget=0.4, gates=_gates(model),
                              options=vlm_kv.CacheOptions(evict_every=4))
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=12, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 12
    assert cache.max_kv_bytes <= cache.budget_bytes() and cache.eviction_steps >= 3


def test_decode_steps_store_each_layers_gate_output_and_keep_the_global_top_k():
    """Decode steps run every layer's gate in one batched call at the end of the forward: each
    stored token still carries its own layer's log beta, and eviction keeps the global top-k."""
    model = tiny_model("llama", num_layers=3)
    gates = _gates(model)
    cache = vlm_kv.make_cache(model, policy="dbtrimkv", budget=0.25, gates=gates,
                              options=vlm_kv.CacheOptions(evict_every=1, scorer_kwargs={"num_sinks": 0}))
    seen = _record_log_betas(cache)
    hidden = {}  # the hidden state each layer's attention saw, per forward

    def keep_hidden(module, args, kwargs):
        hidden.setdefault(module.layer_idx, []).append(kwargs["hidden_states"].clone())

    for module in get_adapter(model).attention_modules(model):
        module.register_forward_pre_hook(keep_hidden, with_kwargs=True)
    ids = torch.randint(5, 200, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(input_ids=ids[:, :32], past_key_values=cache)
        for t in range(32, 40):
            model(input_ids=ids[:, t : t + 1], past_key_values=cache)
            for layer in range(3):  # the newest entry holds this layer's gate output for its token
                want = gates.log_beta(layer, hidden[layer][-1])
                torch.testing.assert_close(seen[layer][-1], want, rtol=1e-5, atol=1e-5)  # batched matmul rounding
                store = cache.layers[layer].store
                view = store.padded_view(states=("log_beta",))
                newest = (view.positions == t) & view.valid
                heads = newest.any(-1)  # [B, H]: the heads that kept it through this step's eviction
                assert int(newest.sum()) == int(heads.sum())
                torch.testing.assert_close(view.state["log_beta"][newest], want[..., 0][heads])
    assert all(len(seen[layer]) == 9 for layer in range(3))  # the prompt and 8 decode steps


def _held(cache):
    """[(layer, batch, head) -> set of positions held]."""
    out = {}
    for i, layer in enumerate(cache.layers):
        view = layer.store.padded_view()
        for h in range(view.positions.shape[1]):
            out[i, h] = set(view.positions[0, h][view.valid[0, h]].tolist())
    return out


def test_each_decode_eviction_keeps_the_global_top_k_of_what_it_held():
    """With gate outputs of decode steps stored at the end of each forward, every eviction step
    keeps the best-scoring entries over all layers and heads among those held before it."""
    model = tiny_model("llama", num_layers=3)
    cache = vlm_kv.make_cache(model, policy="dbtrimkv", budget=0.25, gates=_gates(model),
                              options=vlm_kv.CacheOptions(evict_every=1, scorer_kwargs={"num_sinks": 0}))
    seen = _record_log_betas(cache)
    ids = torch.randint(5, 200, (1, 44), generator=torch.Generator().manual_seed(3))
    steps_that_dropped = 0
    with torch.no_grad():
        model(input_ids=ids[:, :32], past_key_values=cache)
        for t in range(32, 44):
            before = _held(cache)
            model(input_ids=ids[:, t : t + 1], past_key_values=cache)
            after = _held(cache)
            scores = _all_scores(cache, seen)
            kept, dropped = [], []
            for (layer, h), held in before.items():
                candidates = held | {t}
                assert after[layer, h] <= candidates
                kept += [float(scores[layer][0, h, p]) for p in after[layer, h]]
                dropped += [float(scores[layer][0, h, p]) for p in candidates - after[layer, h]]
            assert len(kept) == 3 * 2 * int(0.25 * (t + 1))  # layers x KV heads x budget
            if dropped:  # (a fractional budget grows by one entry every fourth step: nothing to drop)
                assert min(kept) >= max(dropped)
                steps_that_dropped += 1
    assert steps_that_dropped >= 6
    assert len({len(v) for v in after.values()}) > 1  # the heads hold different numbers of entries


def test_a_gate_input_never_stored_is_an_error():
    model = tiny_model("llama", num_layers=3)
    cache = vlm_kv.make_cache(model, policy="dbtrimkv", budget=0.5, gates=_gates(model))
    with torch.no_grad():
        model(input_ids=torch.randint(5, 200, (1, 16)), past_key_values=cache)
    cache.gate_handoff.defer(1, torch.randn(1, 1, model.config.hidden_size))  # a gate ran, its layer never stored
    with pytest.raises(vlm_kv.CacheMisuseError, match=r"layers \[1\].*never stored"):
        cache.end_forward()
    with torch.no_grad():  # nothing is left behind: the next step works
        model(input_ids=torch.randint(5, 200, (1, 1)), past_key_values=cache)
    assert cache.get_seq_length() == 17
