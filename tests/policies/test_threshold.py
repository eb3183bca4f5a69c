"""Threshold mode: keep an entry while (t - i) * log beta_i >= log alpha, whatever the count."""
import pytest
import torch

import vlm_kv
from vlm_kv.gates.retention_gate import GateConfig, RetentionGates, retention_scores
from vlm_kv.models.adapters import get_adapter
from vlm_kv.policies.threshold import RetentionThreshold
from vlm_kv.testing import tiny_model


def _gates(model, seed=0):
    a = get_adapter(model)
    torch.manual_seed(seed)
    g = RetentionGates(GateConfig(hidden_size=a.hidden_size, num_layers=a.num_layers, num_kv_heads=a.num_kv_heads,
                                  width=16, init_bias=1.0, model=a.fingerprint()))
    for p in g.parameters():  # spread the rates so the threshold cuts somewhere inside
        torch.nn.init.normal_(p, std=1.0)
    return g


def _run(model, gates, log_alpha, sinks, decode=3):
    cache = vlm_kv.make_cache(model, "dbtrimkv_threshold", budget=1.0, gates=gates,
                              options=vlm_kv.CacheOptions(evict_every=1, scorer_kwargs={"num_sinks": sinks}, allocation_kwargs={"log_alpha": log_alpha}))
    seen = {}
    store = cache.store_log_beta

    def recording(layer_idx, log_beta):
        seen.setdefault(layer_idx, []).append(log_beta.clone())
        store(layer_idx, log_beta)

    cache.store_log_beta = recording
    ids = torch.randint(5, 200, (1, 48 + decode), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(input_ids=ids[:, :48], past_key_values=cache)
        for t in range(48, 48 + decode):  # every decode step is an eviction step (evict_every=1)
            model(input_ids=ids[:, t : t + 1], past_key_values=cache)
    return cache, seen


def _kept(cache, layer, heads):
    view = cache.layers[layer].store.padded_view()
    return [set(view.positions[0, h][view.valid[0, h]].tolist()) for h in range(heads)]


@pytest.mark.parametrize("log_alpha", [-0.5, -3.0, -12.0])
def test_threshold_keeps_exactly_the_entries_at_or_above_log_alpha(log_alpha):
    model = tiny_model("llama", num_layers=2)
    gates = _gates(model)
    cache, seen = _run(model, gates, log_alpha, sinks=0)
    now = cache.get_seq_length()
    heads = get_adapter(model).num_kv_heads
    n_kept = 0
    for layer in range(cache.num_layers):
        lb = torch.cat(seen[layer], dim=-1)[0]  # [H, T]: every token's log beta
        # an entry evicted at an earlier step scored below log alpha then, and scores only fall
        score = retention_scores(lb, torch.arange(lb.shape[-1]), now)
        for h, kept in enumerate(_kept(cache, layer, heads)):
            want = set(torch.nonzero(score[h] >= log_alpha).flatten().tolist())
            assert kept == want, (layer, h)
            n_kept += len(kept)
    assert 0 < n_kept < cache.num_layers * heads * now  # the threshold cut something, not everything
    per_entry = cache.layers[0].store.bytes_per_entry
    assert cache.kv_bytes()["total"] == n_kept * per_entry
    assert cache.num_entries() == n_kept


def test_threshold_memory_follows_alpha_and_sinks_survive():
    model = tiny_model("llama", num_layers=2)
    gates = _gates(model)
    totals = [_run(model, gates, a, sinks=4)[0].kv_bytes()["total"] for a in (-0.5, -3.0, -12.0)]
    assert totals[0] < totals[1] < totals[2]
    cache, _ = _run(model, gates, -0.5, sinks=4)
    heads = get_adapter(model).num_kv_heads
    for layer in range(cache.num_layers):
        for kept in _kept(cache, layer, heads):
            assert {0, 1, 2, 3} <= kept


def test_threshold_rejects_bad_alpha():
    with pytest.raises(ValueError, match="log_alpha"):
        RetentionThreshold(log_alpha=0.5)
    with pytest.raises(ValueError, match="log_alpha"):
        RetentionThreshold(log_alpha=float("-inf"))
