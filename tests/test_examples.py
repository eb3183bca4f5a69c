"""The README's runnable multi-turn-with-images example does what it says."""
import importlib.util
import os

import torch
from transformers import DynamicCache

import vlm_kv
from vlm_kv.testing import tiny_model

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "multiturn_images.py")


def _example():
    spec = importlib.util.spec_from_file_location("multiturn_images", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_two_image_turns_on_a_full_budget_cache_match_dynamic_cache():
    example = _example()
    model = tiny_model("qwen2_5_vl")
    ref = example.two_turns(model, DynamicCache(config=model.config))
    out = example.two_turns(model, vlm_kv.make_cache(model, policy="snapkv", budget=1.0,
                                                     options=vlm_kv.CacheOptions(scorer_kwargs={"window": 4})))
    assert torch.equal(out, ref)


def test_two_image_turns_on_a_compressed_cache_evict_and_keep_images():
    example = _example()
    model = tiny_model("qwen2_5_vl")
    cache = vlm_kv.make_cache(model, policy="snapkv", budget=0.5,
                              options=vlm_kv.CacheOptions(evict_every=2, scorer_kwargs={"window": 4}))
    out = example.two_turns(model, cache)
    assert out.shape[1] > 0 and cache.eviction_steps >= 4
    assert cache.stats()["per_modality"]["image"] > 0
    assert cache.kv_bytes()["total"] < cache.full_kv_bytes()
