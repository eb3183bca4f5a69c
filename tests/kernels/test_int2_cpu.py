"""The C++ tiered decode kernel (``vlm_kv.kernels.int2_cpu``): against a brute-force softmax, through
a whole generation, on bad input and a failed build. Against the PyTorch path on cache states a
tiered prefill left: ``tests/cache/test_tiered_decode.py``."""
import dataclasses

import pytest
import torch

import vlm_kv
from vlm_kv.attention import backend
from vlm_kv.config import CacheOptions
from vlm_kv.kernels import int2_cpu
from vlm_kv.testing import feed_tokens, random_tokens, tiny_gates, tiny_model

@pytest.fixture(scope="module", autouse=True)
def built():
    try:
        int2_cpu.load()
    except int2_cpu.CpuKernelUnavailable as err:  # the suite's install has a compiler and ninja: this fails
        pytest.fail(str(err))


def test_holes_and_invalid_tail_slots_get_no_weight(prefilled_tiered):
    model, cache = prefilled_tiered("qwen2", "dbtrimkv", "int2", 2, torch.float32)
    layer = cache.layers[0]
    windows = layer.tier.packed_windows()
    w0 = windows[0]
    holes = torch.zeros(w0.key_codes.shape[:2], dtype=torch.bool) if w0.holes is None else w0.holes.clone()
    holes[0, 0] = True
    assert w0.key_ref.shape[1] == 3  # the compact grid: z_lo moves every channel's zero
    poisoned = dataclasses.replace(w0, key_ref=w0.key_ref.clone(), value_zero=w0.value_zero.clone(), holes=holes)
    poisoned.key_ref[0, 0] += 1000.0  # every key of window 0: only slot 0 is a hole
    clean = dataclasses.replace(w0, holes=holes)
    query = torch.randn(2, model.config.num_attention_heads, 1, layer.store.head_dim)
    args = (layer.tier.key_basis, layer.tier.value_basis, layer.scaling)
    base = backend.tiered_decode_attention_cpu(query, layer.store, [clean, windows[1]], *args)
    moved = backend.tiered_decode_attention_cpu(query, layer.store, [poisoned, windows[1]], *args)
    assert not torch.allclose(base, moved)  # the other slots of window 0 feel the change
    poisoned.key_ref[0, 0] = w0.key_ref[0, 0]  # back as it was (fp16: no -= 1000)
    poisoned.value_zero[0, 0] = 6e4  # the hole's value: no weight, no change
    same = backend.tiered_decode_attention_cpu(query, layer.store, [poisoned, windows[1]], *args)
    torch.testing.assert_close(same, base)


def test_decoding_through_the_kernel_matches_the_pure_pytorch_backend():
    """A whole generation: attention_backend "auto" (the kernel on CPU) against "torch"."""
    outs = []
    for name in ("auto", "torch"):
        model = tiny_model("llama")
        tokens = random_tokens(64 + 24, batch=2, vocab=model.config.vocab_size)
        cache = vlm_kv.make_cache(model, policy="dbtrimkv", budget=0.3, tiers="int2", gates=tiny_gates(model),
                                  options=CacheOptions(attention_backend=name))
        outs.append(feed_tokens(model, cache, tokens, 64))
        assert cache.layers[0].tier.num_active > 0
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)


def test_inconsistent_inputs_are_refused_by_name(prefilled_tiered):
    model, cache = prefilled_tiered("llama", "snapkv", "int2", 1, torch.float32)
    layer = cache.layers[0]
    (w,) = layer.tier.packed_windows()
    bad = dataclasses.replace(w, head_windows=w.head_windows + 1)
    query = torch.randn(1, model.config.num_attention_heads, 1, layer.store.head_dim)
    with pytest.raises(RuntimeError, match="head_windows sum to"):
        backend.tiered_decode_attention_cpu(query, layer.store, [bad], layer.tier.key_basis, layer.tier.value_basis,
                                            layer.scaling)


def test_a_build_failure_keeps_the_pytorch_path_with_a_warning(monkeypatch):
    def fail():
        raise int2_cpu.CpuKernelUnavailable("the CPU INT2 kernels could not be built: no compiler")

    monkeypatch.setattr(int2_cpu, "load", fail)
    paths = backend.AttentionPaths("auto")
    with pytest.warns(RuntimeWarning, match="no compiler"):
        assert paths.cpu_int2_decode(torch.zeros(1)) is False
    assert backend.AttentionPaths("torch").cpu_int2_decode(torch.zeros(1)) is False


def _synthetic(head_dim, key_grid, gen, w=8):
    """One sequence: 2 KV heads x 3 query heads, a ragged body, a tail with an invalid slot, INT2
    windows of ``w`` slots with holes, quantized as the tier does (keys per channel, values per token)."""
    from vlm_kv.kernels.int2 import quantize_keys, quantize_keys_compact, quantize_values

    H, g, T = 2, 3, 4
    body_lengths, windows = torch.tensor([5, 7]), torch.tensor([3, 4])
    n = int(windows.sum())
    raw_k, raw_v = torch.randn(n, w, head_dim, generator=gen), torch.randn(n, w, head_dim, generator=gen)
    vc, vs, vz = quantize_values(raw_v)
    if key_grid == "fp16":
        kc, ks, kz = quantize_keys(raw_k)
        ref = torch.empty(n, 0, dtype=torch.float16)
    else:
        kc, kz, ks, ref = quantize_keys_compact(raw_k)
    holes = torch.rand(n, w, generator=gen) < 0.2
    packed = backend.PackedWindows(kc, ks, kz, ref, vc, vs, vz, windows, holes)
    body = (torch.randn(int(body_lengths.sum()), head_dim, generator=gen),
            torch.randn(int(body_lengths.sum()), head_dim, generator=gen), body_lengths)
    tail = (torch.randn(H, T, head_dim, generator=gen), torch.randn(H, T, head_dim, generator=gen),
            torch.tensor([True, False, True, True]))
    return packed, body, tail, g


def _reference(query, packed, body, tail, g, scale):
    from vlm_kv.kernels.int2 import decode_key_grid, dequantize_keys, dequantize_values

    grid = (packed.key_scale, packed.key_zero) if packed.key_ref.shape[1] == 0 else \
        decode_key_grid(packed.key_zero, packed.key_scale, packed.key_ref)
    keys = dequantize_keys(packed.key_codes, *grid)
    values = dequantize_values(packed.value_codes, packed.value_scale, packed.value_zero)
    fp_out, q_out = torch.zeros_like(query), torch.zeros_like(query)
    b_start = torch.cumsum(body[2], 0) - body[2]
    w_start = torch.cumsum(packed.head_windows, 0) - packed.head_windows
    for qh in range(query.shape[0]):
        h = qh // g
        bs, bn = int(b_start[h]), int(body[2][h])
        ws, wn = int(w_start[h]), int(packed.head_windows[h])
        fk = torch.cat([body[0][bs : bs + bn], tail[0][h][tail[2]]])
        fv = torch.cat([body[1][bs : bs + bn], tail[1][h][tail[2]]])
        keep = ~packed.holes[ws : ws + wn].reshape(-1)
        qk = keys[ws : ws + wn].reshape(-1, keys.shape[-1])[keep]
        qv = values[ws : ws + wn].reshape(-1, keys.shape[-1])[keep]
        p = torch.softmax(torch.cat([fk @ query[qh], qk @ query[qh]]) * scale, dim=0)
        fp_out[qh] = p[: len(fk)] @ fv
        q_out[qh] = p[len(fk) :] @ qv
    return fp_out, q_out


@pytest.mark.parametrize("scalar", [False, True])
@pytest.mark.parametrize("head_dim, key_grid", [(16, "int8"), (64, "int8"), (64, "fp16"), (128, "int8")])
def test_the_kernel_equals_a_brute_force_reference(head_dim, key_grid, scalar):
    """head_dim 64 and 128 unpack 16 bytes at a time (AVX-512 where the build has it, its scalar
    twin with ``scalar``); 16 takes the lookup table. The FP and INT2 shares come back apart."""
    gen = torch.Generator().manual_seed(head_dim)
    packed, body, tail, g = _synthetic(head_dim, key_grid, gen)
    query = torch.randn(2 * g, head_dim, generator=gen)
    fp, quantized = int2_cpu.tiered_decode(query, query, body, tail, packed, g, 0.3, scalar=scalar)
    want_fp, want_q = _reference(query, packed, body, tail, g, 0.3)
    torch.testing.assert_close(fp, want_fp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(quantized, want_q, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("w", [3, 5, 12, 16])
def test_windows_of_any_size_equal_the_reference(w):
    """The AVX-512 path takes a window's slots eight at a time; a window of fewer, or of a
    number that is not a multiple of eight, has a short last block."""
    gen = torch.Generator().manual_seed(w)
    packed, body, tail, g = _synthetic(64, "int8", gen, w=w)
    query = torch.randn(2 * g, 64, generator=gen)
    fp, quantized = int2_cpu.tiered_decode(query, query, body, tail, packed, g, 0.3)
    want_fp, want_q = _reference(query, packed, body, tail, g, 0.3)
    torch.testing.assert_close(fp, want_fp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(quantized, want_q, rtol=1e-5, atol=1e-5)


def test_logits_spread_over_hundreds_match_the_reference():
    """Most weights underflow: the vectorised exponential gives exactly 0 below e^-87, as float32's
    own exp nearly does, and the few entries near the maximum carry the output."""
    gen = torch.Generator().manual_seed(7)
    packed, body, tail, g = _synthetic(64, "int8", gen)
    query = torch.randn(2 * g, 64, generator=gen) * 60  # logits spread over hundreds
    fp, quantized = int2_cpu.tiered_decode(query, query, body, tail, packed, g, 0.3)
    want_fp, want_q = _reference(query, packed, body, tail, g, 0.3)
    torch.testing.assert_close(fp, want_fp, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(quantized, want_q, rtol=1e-5, atol=1e-4)


def test_a_slow_build_says_so_and_a_quick_load_stays_silent(monkeypatch, capsys):
    import time

    monkeypatch.setattr(int2_cpu, "BUILD_NOTICE_AFTER", 0.05)
    monkeypatch.setattr(int2_cpu, "_loaded", {})
    monkeypatch.setattr(int2_cpu, "_build", lambda scalar=False: time.sleep(0.3) or "module")
    assert int2_cpu.load() == "module"
    assert "building the CPU tiered-decode kernel" in capsys.readouterr().err
    monkeypatch.setattr(int2_cpu, "_loaded", {})
    monkeypatch.setattr(int2_cpu, "_build", lambda scalar=False: "module")
    assert int2_cpu.load() == "module"
    time.sleep(0.1)  # past the notice's delay: a cancelled notice prints nothing
    assert capsys.readouterr().err == ""


def test_a_loaded_kernel_is_returned_without_starting_a_notice_thread(monkeypatch):
    """load() runs once per layer and decode step; a timer thread per call cost ~2 ms each
    on a busy 2-core machine (cProfile, 8192 tokens: 59 ms a token)."""
    monkeypatch.setattr(int2_cpu, "_loaded", {})
    monkeypatch.setattr(int2_cpu, "_build", lambda scalar=False: "module")
    assert int2_cpu.load() == "module"

    def no_thread(*args, **kwargs):
        raise AssertionError("a cached load started a timer thread")

    monkeypatch.setattr(int2_cpu.threading, "Timer", no_thread)
    assert int2_cpu.load() == "module"
    with pytest.raises(AssertionError, match="timer thread"):
        int2_cpu.load(scalar=True)  # not built yet: the notice timer runs for that build


def test_the_build_is_named_for_this_cpu():
    """-march=native builds are cached by name: the name carries the CPU's feature flags."""
    tag = int2_cpu._host_tag()
    assert len(tag) == 10 and tag == int2_cpu._host_tag()
    assert int2_cpu.load().__name__.startswith(f"vlm_kv_int2_cpu_{tag}")
