"""Policy kvzip: scores from a reconstruction pass (tiny random models: code paths only)."""

import pytest
import torch
from transformers import DynamicCache

import vlm_kv
from vlm_kv.policies.kvzip import MissingReconstructionScores
from vlm_kv.reconstruction import REPEAT_PROMPT, kvzip_prefill, reconstruction_scores
from vlm_kv.testing import random_tokens, tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama"), tiny_tokenizer("llama")


def test_scores_are_the_most_attention_any_reading_query_pays(llama):
    model, tok = llama
    ids = random_tokens(24, seed=1)
    prompt = tok(REPEAT_PROMPT, add_special_tokens=False, return_tensors="pt").input_ids
    chunked = reconstruction_scores(model, ids, prompt, chunk=5)
    # one eager pass over context + prompt + context gives the same maxima
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        attn = model(input_ids=torch.cat([ids, prompt, ids], 1), output_attentions=True).attentions
    finally:
        model.set_attn_implementation(before)
    kv = model.config.num_key_value_heads
    for layer, probs in enumerate(attn):
        reading = probs[:, :, 24:, :24].float().amax(2)
        expected = reading.reshape(1, kv, -1, 24).amax(2)
        torch.testing.assert_close(chunked[layer], expected, atol=1e-5, rtol=1e-4)
    assert model.config._attn_implementation == before


def test_kvzip_keeps_the_entries_reconstruction_reads_most(llama):
    model, tok = llama
    ids = random_tokens(40, seed=2)
    cache = vlm_kv.make_cache(model, "kvzip", 0.3, options=vlm_kv.CacheOptions(evict_every=1 << 20))
    kvzip_prefill(model, cache, ids, tok)
    scores = cache.scorer.scores_by_position
    kept, dropped = [], []
    for i, layer in enumerate(cache.layers):
        positions = layer.store.padded_view(states=()).positions[0]  # [H, L]
        for h in range(positions.shape[0]):
            held = set(positions[h][positions[h] >= 0].tolist())
            for p in range(cache.scorer.num_sinks, 40):
                (kept if p in held else dropped).append(float(scores[i][0, h, p]))
    assert kept and dropped and min(kept) >= max(dropped) - 1e-6  # one global ranking, sinks aside
    assert cache.kv_bytes()["total"] <= cache.budget_bytes()


def test_full_budget_answers_as_the_full_cache_and_misuse_fails_closed(llama):
    model, tok = llama
    ids = random_tokens(30, seed=3)
    cache = vlm_kv.make_cache(model, "kvzip", 1.0)
    kvzip_prefill(model, cache, ids[:, :-1], tok)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                         max_new_tokens=6, do_sample=False)
    ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=DynamicCache(),
                         max_new_tokens=6, do_sample=False)
    assert torch.equal(out, ref)
    with pytest.raises(MissingReconstructionScores, match="kvzip_prefill"):
        model(input_ids=ids, past_key_values=vlm_kv.make_cache(model, "kvzip", 0.3), use_cache=True)
    with pytest.raises(ValueError, match="empty cache"):
        kvzip_prefill(model, cache, ids, tok)
    with pytest.raises(ValueError, match="policy 'kvzip'"):
        kvzip_prefill(model, vlm_kv.make_cache(model, "snapkv", 0.3), ids, tok)
