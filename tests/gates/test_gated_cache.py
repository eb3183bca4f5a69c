"""Learned-gate eviction inside the cache: global top-k, per-head top-M, modality floors/caps."""
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
    stash = cache.stash_log_beta

    def recording(layer_idx, log_beta):
        seen.setdefault(layer_idx, []).append(log_beta.clone())
        stash(layer_idx, log_beta)

    cache.stash_log_beta = recording
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
                              scorer_kwargs={"num_sinks": 0})
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
                              scorer_kwargs={"num_sinks": 0})
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
        cache = vlm_kv.make_cache(model, policy="dbtrimkv", budget=0.3, gates=_gates(model), allocation_kwargs=kwargs)
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
    back = load_gates(str(tmp_path), model=model)
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
    cache = vlm_kv.make_cache(model, policy="dbtrimkv", budget=0.4, gates=_gates(model), evict_every=4)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=12, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 12
    assert cache.max_kv_bytes <= cache.budget_bytes() and cache.eviction_steps >= 3
