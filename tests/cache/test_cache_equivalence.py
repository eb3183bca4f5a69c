"""Budget >= sequence: the compressed cache must reproduce DynamicCache exactly (tokens) and
closely (logits), for every family, with images, batch 2 with left padding, fp32 and bf16."""
import pytest
import torch
from transformers import DynamicCache

import vlm_kv
from vlm_kv.config import CacheOptions
from vlm_kv.models.adapters import SUPPORTED_FAMILIES
from vlm_kv.testing import tiny_inputs, tiny_model

TEXT = {"llama", "qwen2", "qwen3"}


def _generate(model, inputs, cache, steps):
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=steps, do_sample=False,
                         min_new_tokens=steps, output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits, 1).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_full_budget_matches_dynamic_cache(family, dtype):
    model = tiny_model(family, dtype=dtype)
    images = 0 if family in TEXT else 2
    inputs = tiny_inputs(model, batch_size=2, num_images=images, left_pad=3)
    ref_tokens, ref_logits = _generate(model, inputs, DynamicCache(config=model.config), 12)
    # evict_every=4: several eviction steps happen inside the 12 decode steps, so the
    # compacted body (not only the dense tail) is exercised
    cache = vlm_kv.make_cache(model, policy="snapkv", budget=1.0, options=CacheOptions(evict_every=4))
    tokens, logits = _generate(model, inputs, cache, 12)
    assert cache.eviction_steps >= 3
    assert torch.equal(tokens, ref_tokens)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(logits, ref_logits, atol=tol, rtol=tol)
    if images:
        assert cache.stats()["per_modality"]["image"] > 0
