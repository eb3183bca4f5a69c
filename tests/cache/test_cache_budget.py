"""Under budget: bytes held stay within the budget after every eviction step, storage really
shrinks, and kept entries keep their original positions."""
import pytest
import torch
from transformers import DynamicCache

import vlm_kv
from vlm_kv.config import CacheOptions
from vlm_kv.testing import feed_tokens, record_evictions, tiny_gates, tiny_model
from vlm_kv.policies import POLICIES

# text-only model: visual-only policies (fastv, visionzip) are covered with images in tests/policies
BASELINES = [p for p, spec in POLICIES.items() if not spec.needs_gates and not spec.needs_strategy and not spec.visual_only
             and spec.default_tiers is None and not spec.needs_reconstruction]
# polykv: tests/policies/test_polykv.py; qevict, kivi2: tests/tiers/test_window_router.py; kvzip: tests/test_reconstruction.py




@pytest.mark.parametrize("policy", BASELINES)
def test_bytes_stay_within_budget_over_300_decode_steps(policy):
    model = tiny_model("llama")
    tokens = torch.randint(5, model.config.vocab_size, (2, 64 + 300), generator=torch.Generator().manual_seed(0))
    small_window = {"window": 8} if policy in ("snapkv", "pyramidkv", "adakv") else None
    cache = vlm_kv.make_cache(model, policy=policy, budget=0.25,
                              options=CacheOptions(evict_every=8, scorer_kwargs=small_window))
    after_steps = []
    evict = cache.evict

    def checked_evict():
        evict()
        after_steps.append((cache.kv_bytes()["total"], cache.budget_bytes(), cache.full_kv_bytes()))

    cache.evict = checked_evict
    feed_tokens(model, cache, tokens, 64)
    assert len(after_steps) == 1 + 300 // 8
    for held, allowed, full in after_steps:
        assert held <= allowed <= full // 4 + 1
    # allocated storage, not a mask: the tensors themselves are small
    stored = sum(layer.store.body_keys.numel() + layer.store.tail_keys.numel() for layer in cache.layers)
    report = cache.kv_bytes()
    # total = entries held + the tail buffer's spare room (reported apart, at most evict_every tokens per head)
    assert stored * 2 * 4 + report["unused"] == report["total"]
    heads = sum(layer.store.batch_size * layer.store.num_kv_heads for layer in cache.layers)
    assert 0 < report["unused"] <= 8 * heads * cache.layers[0].store.bytes_per_entry
    assert cache.kv_bytes()["total"] < 0.3 * cache.full_kv_bytes()
    assert cache.get_seq_length() == 364


def test_kept_entries_keep_their_original_positions():
    model = tiny_model("llama")
    tokens = torch.randint(5, model.config.vocab_size, (1, 96), generator=torch.Generator().manual_seed(1))
    full = DynamicCache(config=model.config)
    feed_tokens(model, full, tokens, 48)
    cache = vlm_kv.make_cache(model, policy="snapkv", budget=0.3,
                              options=CacheOptions(evict_every=8, scorer_kwargs={"window": 8}))
    feed_tokens(model, cache, tokens, 48)
    # layer 0 keys depend only on token and position, so every kept key must equal the
    # full cache's key at the entry's recorded position (RoPE applied at that position)
    store = cache.layers[0].store
    view = store.padded_view()
    ref = full.layers[0].keys  # [B, H, T, D]
    for h in range(store.num_kv_heads):
        pos = view.positions[0, h][view.valid[0, h]]
        assert len(pos) < 96
        torch.testing.assert_close(view.keys[0, h][view.valid[0, h]], ref[0, h, pos], atol=1e-5, rtol=1e-5)
    assert cache.get_seq_length() == full.get_seq_length() == 96


def test_slack_keeps_room_below_the_budget():
    model = tiny_model("llama")
    tokens = torch.randint(5, model.config.vocab_size, (1, 120), generator=torch.Generator().manual_seed(2))
    cache = vlm_kv.make_cache(model, policy="streaming_llm", budget=0.5, options=CacheOptions(evict_every=4, slack=4))
    feed_tokens(model, cache, tokens, 100)
    # right after the last eviction step each head held cap - slack; 4 more tokens since then at most
    assert cache.stats()["head_length"]["max"] <= cache.budget.capacity(120)


@pytest.mark.parametrize("policy", ["snapkv", "adakv", "dbtrimkv", "h2o"])  # h2o: decode-step attention sums in bf16
def test_bf16_caches_hold_the_budget_at_every_eviction_step(policy):
    model = tiny_model("qwen2", dtype=torch.bfloat16)
    tokens = torch.randint(5, model.config.vocab_size, (2, 48 + 40), generator=torch.Generator().manual_seed(1))
    gates = tiny_gates(model).to(torch.bfloat16) if policy == "dbtrimkv" else None
    scorer_kwargs = {"window": 4} if policy in ("snapkv", "adakv") else None
    cache = vlm_kv.make_cache(model, policy=policy, budget=0.25, gates=gates,
                              options=CacheOptions(evict_every=4, scorer_kwargs=scorer_kwargs))
    held = record_evictions(cache)
    feed_tokens(model, cache, tokens, 48)
    assert len(held) == 1 + 40 // 4
    assert all(h <= allowed for h, allowed in held)
    assert cache.layers[0].store.body_keys.dtype == torch.bfloat16
