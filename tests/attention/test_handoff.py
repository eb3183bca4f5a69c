"""Every path where the compressed cache's entries would be bypassed raises instead."""
import pytest
import torch
from transformers import DynamicCache

import vlm_kv
from vlm_kv.attention import handoff
from vlm_kv.attention.handoff import AttentionBypassError
from vlm_kv.config import CacheOptions
from vlm_kv.testing import tiny_model

WINDOW_4 = CacheOptions(scorer_kwargs={"window": 4})  # snapkv / adakv observe 4 queries


def test_switching_the_attention_implementation_after_make_cache_raises():
    model = tiny_model("llama")
    cache = vlm_kv.make_cache(model, policy="snapkv", budget=1.0)
    model.set_attn_implementation("sdpa")
    with pytest.raises(AttentionBypassError, match="switched after make_cache"):
        model.generate(input_ids=torch.randint(5, 100, (1, 8)), past_key_values=cache, max_new_tokens=3)


def test_attach_again_after_a_switch_restores_the_cache_path():
    model = tiny_model("llama")
    ids = torch.randint(5, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    ref = model.generate(input_ids=ids, past_key_values=DynamicCache(config=model.config), max_new_tokens=4, do_sample=False)
    cache = vlm_kv.make_cache(model, policy="snapkv", budget=1.0)
    model.set_attn_implementation("sdpa")
    cache = vlm_kv.make_cache(model, policy="snapkv", budget=1.0)
    out = model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, ref)


def test_a_hand_off_never_consumed_raises():
    model = tiny_model("llama")
    cache = vlm_kv.make_cache(model, policy="snapkv", budget=1.0)
    k = torch.randn(1, model.config.num_key_value_heads, 3, model.config.head_dim)
    cache.begin_forward(None, None, 3)
    cache.update(k, k, 0)
    with pytest.raises(AttentionBypassError, match="layer 0 stored its keys/values"):
        cache.update(k, k, 1)
    handoff.end_forward_quietly()


def test_a_forward_ending_with_a_pending_hand_off_raises():
    model = tiny_model("llama")
    cache = vlm_kv.make_cache(model, policy="snapkv", budget=1.0)
    k = torch.randn(1, model.config.num_key_value_heads, 3, model.config.head_dim)
    cache.begin_forward(None, None, 3)
    cache.update(k, k, 0)
    with pytest.raises(AttentionBypassError, match="did not run through"):
        cache.end_forward()


def test_vlm_kv_attention_without_cache_update_raises_during_a_compressed_forward():
    model = tiny_model("llama")
    cache = vlm_kv.make_cache(model, policy="snapkv", budget=1.0)
    module = model.model.layers[0].self_attn
    q = torch.randn(1, model.config.num_attention_heads, 2, model.config.head_dim)
    k = torch.randn(1, model.config.num_key_value_heads, 2, model.config.head_dim)
    cache.begin_forward(None, None, 2)
    with pytest.raises(AttentionBypassError, match="without cache.update"):
        handoff.vlm_kv_attention(module, q, k, k, None)
    handoff.end_forward_quietly()
    # outside a compressed forward the same call is plain SDPA
    out, _ = handoff.vlm_kv_attention(module, q, k, k, None)
    assert out.shape == (1, 2, model.config.num_attention_heads, model.config.head_dim)


def test_held_bytes_count_remembered_queries_and_metadata():
    model = tiny_model("llama")
    cache = vlm_kv.make_cache(model, policy="snapkv", budget=0.5, options=WINDOW_4)
    model(input_ids=torch.randint(5, 100, (1, 40)), past_key_values=cache)
    report = cache.kv_bytes()
    queries = sum(layer.recent.queries.untyped_storage().nbytes() + layer.recent.positions.untyped_storage().nbytes()
                  for layer in cache.layers)
    assert report["query_window"] == queries > 0
    assert report["metadata"] > 0
    assert report["held"] == report["total"] + report["metadata"] + report["query_window"] + report["gate_stash"]


def test_num_return_sequences_with_sampling_matches_dynamic_cache():
    model = tiny_model("llama")
    ids = torch.randint(5, 100, (1, 12), generator=torch.Generator().manual_seed(1))
    kwargs = dict(input_ids=ids, max_new_tokens=6, do_sample=True, num_return_sequences=2)
    torch.manual_seed(0)
    ref = model.generate(**kwargs, past_key_values=DynamicCache(config=model.config))
    torch.manual_seed(0)
    out = model.generate(**kwargs, past_key_values=vlm_kv.make_cache(model, policy="snapkv", budget=1.0, options=CacheOptions(evict_every=2)))
    assert out.shape[0] == 2 and torch.equal(out, ref)


def test_batch_repeat_interleave_repeats_each_sequence_entries():
    model = tiny_model("llama")
    cache = vlm_kv.make_cache(model, policy="adakv", budget=0.5, options=WINDOW_4)
    ids = torch.randint(5, 100, (2, 30), generator=torch.Generator().manual_seed(2))
    model(input_ids=ids, past_key_values=cache)
    before = [layer.store.padded_view() for layer in cache.layers]
    cache.batch_repeat_interleave(3)
    for layer, old in zip(cache.layers, before):
        new = layer.store.padded_view()
        assert new.keys.shape[0] == 6
        for b in range(6):
            assert torch.equal(new.keys[b], old.keys[b // 3]) and torch.equal(new.positions[b], old.positions[b // 3])


def test_an_error_half_way_through_a_forward_loses_nothing():
    model = tiny_model("llama")
    ids = torch.randint(5, 100, (1, 30), generator=torch.Generator().manual_seed(3))
    ref = vlm_kv.make_cache(model, policy="snapkv", budget=1.0, options=WINDOW_4)
    model(input_ids=ids, cache=ref)
    cache = vlm_kv.make_cache(model, policy="snapkv", budget=1.0, options=WINDOW_4)
    model(input_ids=ids, cache=cache)
    second = model.model.layers[1].self_attn
    handle = second.register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        model(input_ids=ids[:, :1], cache=cache)  # layer 0 stores its token, then layer 1 fails
    handle.remove()
    assert cache.get_seq_length() == ref.get_seq_length() == 30
    assert [layer.seen for layer in cache.layers] == [30, 30]
    nxt = ids[:, :1]
    torch.testing.assert_close(model(input_ids=nxt, cache=cache).logits, model(input_ids=nxt, cache=ref).logits)
