"""make_cache(..., options=CacheOptions(prefill_chunk=N)): a long prompt enters in chunks with an eviction step after each."""
import pytest
import torch
from transformers import DynamicCache

import vlm_kv
from vlm_kv.config import CacheOptions
from vlm_kv.testing import tiny_inputs, tiny_model


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("policy", ["snapkv", "h2o", "streaming_llm"])
def test_full_budget_with_chunks_matches_dynamic_cache(family, policy):
    model = tiny_model(family)
    inputs = tiny_inputs(model, batch_size=2, num_images=0, text_len=50, left_pad=3)
    kwargs = dict(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    ref = model.generate(**kwargs, cache=DynamicCache(config=model.config))
    cache = vlm_kv.make_cache(model, policy=policy, budget=1.0, options=CacheOptions(prefill_chunk=16, evict_every=2))
    out = model.generate(**kwargs, cache=cache)
    assert cache.chunked_prefills == 1 and cache.eviction_steps >= 4  # 4 chunks, then decode steps
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(ref.logits), rtol=1e-4, atol=1e-4)


def test_chunked_prefill_peak_is_about_budget_plus_chunk():
    model = tiny_model("llama")
    ids = torch.randint(16, 200, (1, 400), generator=torch.Generator().manual_seed(0))
    whole = vlm_kv.make_cache(model, policy="snapkv", budget=0.1, options=CacheOptions(scorer_kwargs={"window": 4}))
    model(input_ids=ids, cache=whole)
    chunked = vlm_kv.make_cache(model, policy="snapkv", budget=0.1,
                                options=CacheOptions(prefill_chunk=40, scorer_kwargs={"window": 4}))
    model(input_ids=ids, cache=chunked)
    per_token = whole.full_kv_bytes() // 400
    # unchunked, each layer is evicted right after its attention: one full layer on top of the budget
    layer_bytes = whole.full_kv_bytes() // whole.num_layers
    assert whole.peak_kv_bytes <= whole.budget_bytes() + layer_bytes < whole.full_kv_bytes()
    # at most the budget for the tokens before the last chunk, plus the chunk itself
    assert chunked.peak_kv_bytes <= (int(0.1 * 360) + 40) * per_token
    assert chunked.kv_bytes()["total"] <= chunked.budget_bytes()
    assert chunked.get_seq_length() == whole.get_seq_length() == 400


def test_chunked_prefill_returns_the_last_chunk_logits_of_a_full_budget_run():
    model = tiny_model("qwen2")
    ids = torch.randint(16, 200, (1, 70), generator=torch.Generator().manual_seed(1))
    ref = model(input_ids=ids, cache=DynamicCache(config=model.config)).logits
    cache = vlm_kv.make_cache(model, policy="tova", budget=1.0, options=CacheOptions(prefill_chunk=32))
    out = model(input_ids=ids, cache=cache).logits
    assert out.shape[1] == 70 - 64  # the earlier chunks' logits are not kept
    torch.testing.assert_close(out, ref[:, 64:], rtol=1e-4, atol=1e-4)


def test_a_forward_with_images_is_prefilled_in_one_piece():
    model = tiny_model("qwen2_5_vl")
    inputs = tiny_inputs(model, num_images=2, text_len=30)
    cache = vlm_kv.make_cache(model, policy="snapkv", budget=0.5,
                              options=CacheOptions(prefill_chunk=8, scorer_kwargs={"window": 4}))
    model(**inputs, cache=cache)
    assert cache.chunked_prefills == 0 and cache.eviction_steps == 1
    assert cache.stats()["per_modality"]["image"] > 0
