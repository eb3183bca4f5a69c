"""generate() takes our cache under transformers 5.x's `cache=` and the older `past_key_values=`."""

import warnings

import torch

from vlm_kv import make_cache
from vlm_kv.api import cache_kwarg
from vlm_kv.testing import tiny_inputs, tiny_model


def _generate(model, inputs, spelling):
    cache = make_cache(model, policy="snapkv", budget=40)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the old spelling's deprecation notice
        out = model.generate(**inputs, **{spelling: cache}, max_new_tokens=6, do_sample=False)
    return out, cache


def test_both_spellings_use_the_compressed_cache_and_agree():
    model = tiny_model("qwen2_5_vl")
    inputs = tiny_inputs(model, num_images=1, text_len=40)
    assert cache_kwarg(model) == "cache"  # transformers 5.24's current name
    new, new_cache = _generate(model, inputs, "cache")
    old, old_cache = _generate(model, inputs, "past_key_values")
    assert torch.equal(new, old)
    full = make_cache(model, policy="full", budget=1.0)
    model.generate(**inputs, cache=full, max_new_tokens=6, do_sample=False)
    full_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in full.layers)
    for cache in (new_cache, old_cache):  # the budget held under either name
        assert 0 < cache.kv_bytes()["total"] < full_bytes
