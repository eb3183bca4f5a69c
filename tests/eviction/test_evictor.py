"""Evictor: a prefill on an empty cache is evicted layer by layer, keeping exactly what the
end-of-forward step keeps, with the prompt's full KV in at most one layer at a time."""
import pytest
import torch

import vlm_kv
from vlm_kv.storage.allocation import GlobalTopK
from vlm_kv.cache.cache import CompressedCache
from vlm_kv.config import CacheOptions
from vlm_kv.eviction.evictor import LayerwiseStep
from vlm_kv.testing import attention_fails_at_call, tiny_gates, tiny_inputs, tiny_model

WINDOW_4 = CacheOptions(scorer_kwargs={"window": 4})  # snapkv / adakv observe 4 queries


def _run(model, inputs, policy, **kwargs):
    cache = vlm_kv.make_cache(model, policy=policy, budget=0.3, **kwargs)
    out = model.generate(**inputs, max_new_tokens=5, min_new_tokens=5, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, cache=cache)
    held = [layer.held_positions()[0] for layer in cache.layers]
    return out, cache, held


@pytest.mark.parametrize("policy", ["snapkv", "h2o", "adakv", "pyramidkv", "tova", "dbtrimkv", "trimkv"])
def test_layerwise_prefill_keeps_what_the_end_of_forward_step_keeps(policy, monkeypatch):
    model = tiny_model("qwen2", num_layers=4)
    inputs = tiny_inputs(model, batch_size=2, num_images=0, text_len=60, left_pad=5)
    kwargs = {"gates": tiny_gates(model, kind=policy)} if "trimkv" in policy else {}
    layerwise, cache, held = _run(model, inputs, policy, **kwargs)
    monkeypatch.setattr(CompressedCache, "after_prefill_attention", lambda self, layer: None)
    at_end, end_cache, end_held = _run(model, inputs, policy, **kwargs)
    assert torch.equal(layerwise.sequences, at_end.sequences)
    torch.testing.assert_close(torch.stack(layerwise.logits), torch.stack(at_end.logits), rtol=0, atol=0)
    for a, b in zip(held, end_held):
        assert torch.equal(a, b)
    assert cache.evicted_entries == end_cache.evicted_entries
    assert cache.eviction_steps == end_cache.eviction_steps
    # the layer-by-layer prefill held less; a per-layer policy held the budget plus one full layer at most
    # (a global top-k keeps more in early layers, until it has seen enough scores)
    assert cache.peak_kv_bytes < end_cache.peak_kv_bytes
    if policy != "dbtrimkv":
        assert cache.peak_kv_bytes <= cache.budget_bytes() + cache.full_kv_bytes() // cache.num_layers
    assert cache.max_kv_bytes <= cache.budget_bytes()


def test_unchunked_prefill_peak_is_the_budget_plus_one_layer():
    model = tiny_model("llama", num_layers=6)
    ids = torch.randint(16, 200, (1, 300), generator=torch.Generator().manual_seed(0))
    cache = vlm_kv.make_cache(model, policy="snapkv", budget=0.1, options=WINDOW_4)
    model(input_ids=ids, cache=cache)
    full_layer = cache.full_kv_bytes() // cache.num_layers
    assert cache.peak_kv_bytes <= cache.budget_bytes() + full_layer
    assert cache.kv_bytes()["total"] <= cache.budget_bytes()


def test_a_global_step_drops_early_only_what_the_final_top_k_never_keeps():
    gen = torch.Generator().manual_seed(3)
    layers = [torch.randn(2, 3, 40, generator=gen).round(decimals=1) for _ in range(5)]  # rounding makes ties
    layers[2][0, 1, 7:] = float("-inf")                     # empty slots
    layers[1][1, 0, :3] = float("inf")                      # protected entries
    caps = torch.tensor([4, 9])
    final = GlobalTopK().keep_all(layers, caps)
    step = LayerwiseStep(caps, scorer=None, allocation=GlobalTopK(), num_layers=5)
    k = caps * (5 * 3)
    for scores, keep in zip(layers, final):
        early = step.never_dropped(scores, k)
        assert not bool((keep & ~early).any())              # nothing the final choice keeps went early
        assert not bool((early & (scores == float("-inf"))).any())
    assert int(early.sum()) < early.numel()                 # and the last layer did lose entries early


def test_a_failure_after_layerwise_eviction_leaves_the_cache_empty_and_usable():
    model = tiny_model("llama", num_layers=3)
    ids = torch.randint(16, 200, (1, 50), generator=torch.Generator().manual_seed(1))
    cache = vlm_kv.make_cache(model, policy="snapkv", budget=0.2, options=WINDOW_4)
    last = model.model.layers[2].self_attn
    handle = last.register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        model(input_ids=ids, cache=cache)  # layers 0 and 1 were evicted already
    handle.remove()
    assert cache.get_seq_length() == 0 and cache.num_entries() == 0
    ref = vlm_kv.make_cache(model, policy="snapkv", budget=0.2, options=WINDOW_4)
    torch.testing.assert_close(model(input_ids=ids, cache=cache).logits, model(input_ids=ids, cache=ref).logits)
    assert cache.num_entries() == ref.num_entries()


def test_a_second_turn_is_evicted_at_the_end_of_its_forward():
    model = tiny_model("llama", num_layers=3)
    ids = torch.randint(16, 200, (1, 80), generator=torch.Generator().manual_seed(2))
    cache = vlm_kv.make_cache(model, policy="snapkv", budget=0.2, options=WINDOW_4)
    model(input_ids=ids[:, :50], cache=cache)
    held = cache.kv_bytes()["total"]
    cache.peak_kv_bytes = 0
    model(input_ids=ids[:, 50:], cache=cache)
    # every layer held the old entries plus the whole new turn when the step ran
    per_token_layer = cache.full_kv_bytes() // 80 // cache.num_layers
    assert cache.peak_kv_bytes >= held + 30 * per_token_layer * cache.num_layers


def test_each_chunk_of_a_prompt_is_evicted_layer_by_layer_and_keeps_what_end_of_forward_keeps(monkeypatch):
    model = tiny_model("llama", num_layers=4)
    ids = torch.randint(16, 200, (1, 200), generator=torch.Generator().manual_seed(4))
    chunked = vlm_kv.make_cache(model, policy="snapkv", budget=0.1, options=CacheOptions(prefill_chunk=50, scorer_kwargs={"window": 4}))
    logits = model(input_ids=ids, cache=chunked).logits
    full_layer_chunk = chunked.full_kv_bytes() // chunked.num_layers * 50 // 200
    # later chunks too: the budget so far plus one layer's chunk, not every layer's chunk
    assert chunked.peak_kv_bytes <= chunked.budget_bytes() + full_layer_chunk
    monkeypatch.setattr(CompressedCache, "after_prefill_attention", lambda self, layer: None)
    at_end = vlm_kv.make_cache(model, policy="snapkv", budget=0.1, options=CacheOptions(prefill_chunk=50, scorer_kwargs={"window": 4}))
    assert torch.equal(model(input_ids=ids, cache=at_end).logits, logits)
    for a, b in zip(chunked.layers, at_end.layers):
        assert torch.equal(a.held_positions()[0], b.held_positions()[0])


def test_a_failure_in_a_later_chunk_empties_the_cache_the_call_started_with():
    model = tiny_model("llama", num_layers=3)
    ids = torch.randint(16, 200, (1, 120), generator=torch.Generator().manual_seed(5))
    cache = vlm_kv.make_cache(model, policy="snapkv", budget=0.2, options=CacheOptions(prefill_chunk=40, scorer_kwargs={"window": 4}))
    # layer 2 of the third chunk (three attention calls per chunk)
    with attention_fails_at_call(model, 3 * 3), pytest.raises(RuntimeError, match="boom"):
        model(input_ids=ids, cache=cache)
    assert cache.get_seq_length() == 0 and cache.num_entries() == 0
    ref = vlm_kv.make_cache(model, policy="snapkv", budget=0.2, options=CacheOptions(prefill_chunk=40, scorer_kwargs={"window": 4}))
    torch.testing.assert_close(model(input_ids=ids, cache=cache).logits, model(input_ids=ids, cache=ref).logits)
