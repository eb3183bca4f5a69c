"""Spill tier of the INT2 tiers: host copies of the original FP windows make promotion lossless,
live and die with their ledger entries, stay outside the byte budget and show in the reports."""
import argparse

import pytest
import torch
from transformers import DynamicCache

import vlm_kv
from vlm_kv.api import tiers_with_fields
from vlm_kv.arguments.tier_flags import add_tier_args, tier_kwargs
from vlm_kv.config import TierConfig
from vlm_kv.testing import (
    feed_tokens,
    random_tokens,
    record_evictions,
    route_with_forced_decision,
    tiny_gates,
    tiny_model,
)
from vlm_kv.tiers.int2_tier import SpillCopies
from vlm_kv.tiers.window_router import EVICT, FP, INT2


def _original_kv(model, tokens):
    """Per layer [B, H, T, D] keys and values as a full cache holds them (the originals)."""
    ref = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=tokens, past_key_values=ref, use_cache=True)
    return [(layer.keys, layer.values) for layer in ref.layers]


def _fp_window(layer, key, w=8):
    """Keys and values the FP store holds for window ``key`` of layer 0, in position order."""
    view = layer.store.padded_view(with_values=True)
    H = view.keys.shape[1]
    b, h = key[0] // H, key[0] % H
    pos = view.positions[b, h]
    sel = view.valid[b, h] & ((pos // w) == key[1])
    order = torch.argsort(pos[sel])
    return pos[sel][order], view.keys[b, h][sel][order], view.values[b, h][sel][order]


@pytest.mark.parametrize("spill, key_rope", [(True, "post"), (True, "pre"), (False, "post")])
def test_promotion_restores_the_original_entries_only_with_spill(spill, key_rope):
    model = tiny_model("llama")
    tokens = random_tokens(64, vocab=model.config.vocab_size)
    originals = _original_kv(model, tokens)
    cache = vlm_kv.make_cache(model, policy="h2o", budget=0.5, tiers={"spill": spill, "key_rope": key_rope})
    feed_tokens(model, cache, tokens, 64)
    layer = cache.layers[0]
    tier = layer.tier
    assert tier.num_active > 0
    key = (int(tier.row[0]), int(tier.window_id[0]))
    route_with_forced_decision(cache, key, FP)  # promotion
    pos, keys, values = _fp_window(layer, key)
    assert pos.numel() == 8
    H = layer.store.num_kv_heads
    ref_k = originals[0][0][key[0] // H, key[0] % H, pos]
    ref_v = originals[0][1][key[0] // H, key[0] % H, pos]
    counters = tier.counters
    assert counters.promotions >= 1
    stats = cache.stats()["per_tier"]
    if spill:
        assert torch.equal(keys, ref_k) and torch.equal(values, ref_v)  # byte-identical
        assert stats["lossless_promotions"] == stats["promotions"] >= 1
    else:
        assert not torch.equal(keys, ref_k) and not torch.equal(values, ref_v)  # dequantized, lossy
        assert stats["lossless_promotions"] == 0
    # the promoted window's ledger entry is dormant and keeps its host copy while the ledger keeps the codes
    if spill:
        assert len(tier.spill) == len(tier) > tier.num_active
        assert stats["spill_windows"] == sum(len(lay.tier) for lay in cache.layers)
        # demoted again (codes reused) and promoted again: still the originals
        route_with_forced_decision(cache, key, INT2)
        route_with_forced_decision(cache, key, FP)
        pos2, keys2, values2 = _fp_window(layer, key)
        assert torch.equal(pos2, pos) and torch.equal(keys2, ref_k) and torch.equal(values2, ref_v)
        assert tier.counters.ledger_reuses >= 1


def test_spill_bytes_are_the_host_copies_and_fall_when_windows_are_evicted():
    model = tiny_model("llama")
    cache = vlm_kv.make_cache(model, policy="h2o", budget=0.5, tiers={"spill": True})
    feed_tokens(model, cache, random_tokens(64, vocab=model.config.vocab_size), 64)
    tiers = [layer.tier for layer in cache.layers]
    for tier in tiers:
        assert tier.spill.keys.device.type == "cpu" and tier.spill.values.device.type == "cpu"
        assert len(tier.spill) == len(tier)  # one host copy per ledger entry
        assert tier.spill.keys.dtype == tier.dtype
    host = sum(t.spill.keys.nbytes + t.spill.values.nbytes for t in tiers)
    kv = cache.kv_bytes()
    assert kv["per_tier"]["spill"] == host > 0
    w, D = tiers[0].window, tiers[0].head_dim
    dtype_bytes = torch.empty(0, dtype=tiers[0].dtype).element_size()
    assert host == sum(len(t) for t in tiers) * 2 * w * D * dtype_bytes
    # the host copies are outside the device total
    assert sum(v for k, v in kv["per_tier"].items() if k != "spill") == kv["total"]

    layer = cache.layers[0]
    tier = layer.tier
    key = (int(tier.row[0]), int(tier.window_id[0]))
    before_layer, before_total = tier.spill_bytes(), cache.kv_bytes()["per_tier"]["spill"]
    route_with_forced_decision(cache, key, EVICT)
    assert not bool(((tier.row == key[0]) & (tier.window_id == key[1])).any())
    assert tier.spill_bytes() == before_layer - 2 * w * D * dtype_bytes
    assert cache.kv_bytes()["per_tier"]["spill"] < before_total
    assert tier.spill.keys.shape[0] == len(tier)  # exactly sized: the dropped copy's memory is gone


@pytest.mark.parametrize("policy", ["qevict", "dbtrimkv"])
def test_budget_holds_with_spill_and_excludes_the_host_copies(policy):
    model = tiny_model("llama")
    kw = {"gates": tiny_gates(model)} if policy == "dbtrimkv" else {}
    cache = vlm_kv.make_cache(model, policy=policy, budget=0.2, tiers={"spill": True}, **kw)
    steps = record_evictions(cache)
    spill_seen = []
    evict = cache.evict

    def watching():
        evict()
        spill_seen.append(cache.kv_bytes()["per_tier"]["spill"])

    cache.evict = watching
    feed_tokens(model, cache, random_tokens(64 + 160, batch=2, vocab=model.config.vocab_size), 64)
    assert len(steps) == 1 + 160 // 8
    for held, allowed in steps:
        assert held <= allowed
    # the host copies would not fit under the budget: they are really left out of it
    assert max(spill_seen) > 0
    assert any(held + s > allowed for (held, allowed), s in zip(steps, spill_seen))
    stats = cache.stats()["per_tier"]
    assert stats["spill_windows"] == stats["int2_windows"] + stats["ledger_windows"]


def test_spill_with_budget_one_equals_dynamic_cache():
    model = tiny_model("llama")
    tokens = random_tokens(40 + 30, batch=2, vocab=model.config.vocab_size)
    ref = feed_tokens(model, DynamicCache(config=model.config), tokens, 40)
    cache = vlm_kv.make_cache(model, policy="h2o", budget=1.0, tiers={"spill": True})
    out = feed_tokens(model, cache, tokens, 40)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert cache.stats()["per_tier"]["quantized"] == 0 and cache.kv_bytes()["per_tier"]["spill"] == 0


def test_spill_is_off_by_default_and_reported_as_zero():
    assert TierConfig().spill is False
    model = tiny_model("llama")
    cache = vlm_kv.make_cache(model, policy="qevict", budget=0.3)
    feed_tokens(model, cache, random_tokens(64, vocab=model.config.vocab_size), 64)
    assert cache.stats()["per_tier"]["int2_windows"] > 0
    assert all(layer.tier.spill is None for layer in cache.layers)
    assert cache.kv_bytes()["per_tier"]["spill"] == 0 and cache.stats()["per_tier"]["spill_windows"] == 0


def test_spill_cli_option_parses_and_needs_tiers():
    p = argparse.ArgumentParser()
    add_tier_args(p)
    assert tier_kwargs(p.parse_args(["--tiers", "int2", "--spill"])) == {"tiers": {"spill": True}}
    assert tier_kwargs(p.parse_args(["--tiers", "int2"])) == {"tiers": "int2"}
    with pytest.raises(ValueError, match="--spill"):
        tier_kwargs(p.parse_args(["--spill"]))


def test_spill_settings_are_checked():
    with pytest.raises(ValueError, match="spill must be True or False"):
        TierConfig(spill="yes")
    # flat settings (model arguments, grid cells) that ask for a spill tier on an untiered cache
    with pytest.raises(ValueError, match="spill=.*pass tiers=int2"):
        tiers_with_fields("h2o", None, {"spill": True})
    assert tiers_with_fields("qevict", None, {"spill": True}) == {"spill": True}  # tiered by itself


def test_spill_copies_stay_on_the_host_pinned_only_where_pinning_exists():
    assert SpillCopies.pin_for(torch.device("cpu")) is False
    keys, values = torch.ones(2, 8, 4, dtype=torch.bfloat16), torch.zeros(2, 8, 4, dtype=torch.bfloat16)
    # asked to pin: pinned where an accelerator allocator exists, pageable host memory (not an error) elsewhere
    copies = SpillCopies.from_device(keys, values, pin=True)
    assert copies.keys.device.type == "cpu" and copies.keys.is_pinned() == torch.cuda.is_available()
    picked = copies.select(torch.tensor([1]), pin=True)
    assert picked.keys.device.type == "cpu" and picked.nbytes() == 2 * 8 * 4 * 2
    assert torch.equal(picked.keys, keys[1:]) and torch.equal(picked.values, values[1:])
