"""The cache's decode steps through the Triton paged kernel (interpreted on CPU) equal the PyTorch path."""
import pytest
import torch
from transformers import DynamicCache

import vlm_kv
from vlm_kv.testing import tiny_inputs, tiny_model


@pytest.mark.parametrize("policy", ["snapkv", "adakv"])  # uniform body (dense view) and ragged body
def test_triton_decode_in_the_cache_matches_the_torch_path(policy, triton_kernels):
    model = tiny_model("qwen2")
    ids = torch.randint(16, 200, (1, 40), generator=torch.Generator().manual_seed(0))
    kwargs = dict(input_ids=ids, max_new_tokens=5, min_new_tokens=5, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    runs = {}
    for backend in ("torch", "triton"):
        cache = vlm_kv.make_cache(model, policy=policy, budget=0.5, options=vlm_kv.CacheOptions(
            evict_every=2, scorer_kwargs={"window": 4}, attention_backend=backend))
        runs[backend] = model.generate(**kwargs, cache=cache)
        assert cache.paths.triton_decode(ids.float()) == (backend == "triton")
    assert torch.equal(runs["triton"].sequences, runs["torch"].sequences)
    torch.testing.assert_close(torch.stack(runs["triton"].logits), torch.stack(runs["torch"].logits), rtol=1e-4, atol=1e-4)


def test_triton_decode_with_a_full_budget_matches_dynamic_cache(triton_kernels):
    model = tiny_model("llama")
    inputs = tiny_inputs(model, batch_size=2, num_images=0, text_len=20, left_pad=2)
    kwargs = dict(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    ref = model.generate(**kwargs, cache=DynamicCache(config=model.config))
    out = model.generate(**kwargs, cache=vlm_kv.make_cache(model, policy="tova", budget=1.0, options=vlm_kv.CacheOptions(
        evict_every=2, attention_backend="triton")))
    assert torch.equal(out, ref)


@pytest.mark.parametrize("fp_unit, key_grid, basis", [("window", "fp16", "channel"), ("token", "fp16", "channel"),
                                                     ("token", "int8", "channel"), ("token", "int8", "hadamard"),
                                                     ("window", "fp16", "hadamard"), ("token", "int8", "hadamard_keys")])
def test_triton_decode_over_fp_and_int2_tiers_matches_the_torch_path(triton_kernels, monkeypatch, fp_unit, key_grid,
                                                                     basis):
    # token: windows with holes, read with a slot mask; int8: the compact key grid, decoded for the kernel;
    # hadamard: rotated codes, read as their own source with the rotated query
    """The kernel reads the packed INT2 windows beside the FP body and tail, in one softmax."""
    from vlm_kv.attention import backend as attention_backend

    calls = []
    kernel_path = attention_backend.tiered_decode_attention_triton

    def counted(*args, **kwargs):
        calls.append(1)
        return kernel_path(*args, **kwargs)

    monkeypatch.setattr(attention_backend, "tiered_decode_attention_triton", counted)
    model = tiny_model("qwen2")
    ids = torch.randint(16, 200, (1, 72), generator=torch.Generator().manual_seed(0))
    kwargs = dict(input_ids=ids, max_new_tokens=10, min_new_tokens=10, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    runs, held = {}, {}
    for backend in ("torch", "triton"):
        cache = vlm_kv.make_cache(model, policy="snapkv", budget=0.3,
                                  tiers={"window": 4, "fp_unit": fp_unit, "key_grid": key_grid, "basis": basis},
                                  options=vlm_kv.CacheOptions(scorer_kwargs={"window": 4}, attention_backend=backend))
        runs[backend] = model.generate(**kwargs, cache=cache)
        assert cache.layers[0].tier.rotated == (basis != "channel")
        held[backend] = cache.stats()["per_tier"]
        if fp_unit == "token":
            assert not all(layer.tier.windows_full for layer in cache.layers)  # holes reached the kernel
    assert held["triton"]["int2_windows"] > 0 and held["triton"] == held["torch"]
    assert len(calls) >= 9 * model.config.num_hidden_layers  # every decode step after the prefill's routing
    assert torch.equal(runs["triton"].sequences, runs["torch"].sequences)
    torch.testing.assert_close(torch.stack(runs["triton"].logits), torch.stack(runs["torch"].logits), rtol=1e-4, atol=1e-4)
