import pytest
import torch

from kernel_stores import FP_KEYS, INT2_KEYS, naive_decode, random_int2_store, random_paged_store
from vlm_kv.kernels import dispatch
from vlm_kv.kernels.paged_torch import mixed_decode_attention_torch, paged_decode_attention_torch

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _fp_args(store):
    return [store[k] for k in FP_KEYS]


def _int2_args(store):
    return [store[k] for k in INT2_KEYS]


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_reference_equals_row_by_row_sdpa(group, dtype):
    store = random_paged_store(2, 2, group, 32, [0, 5, 300, 17], block_size=16, dtype=dtype)
    out = paged_decode_attention_torch(*_fp_args(store), None)
    assert out.shape == (2, 2 * group, 32) and out.dtype == dtype
    assert torch.allclose(out.float(), naive_decode(store), **TOL[dtype])
    assert bool((out[0, :group] == 0).all())  # empty row gives zeros


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_reference_equals_sdpa_over_dequantized_entries(group, dtype):
    fp = random_paged_store(2, 2, group, 32, [0, 9, 0, 120], block_size=8, dtype=dtype, seed=4)
    int2 = random_int2_store(4, 32, [0, 3, 5, 12], window=8)
    out = mixed_decode_attention_torch(*_fp_args(fp), *_int2_args(int2), 0.3)
    assert torch.allclose(out.float(), naive_decode(fp, int2, scaling=0.3), **TOL[dtype])
    assert bool((out[0, :group] == 0).all())  # no FP and no INT2 entries
    assert bool((out[1, :group] != 0).any())  # INT2 only


def test_mixed_without_windows_equals_paged():
    fp = random_paged_store(2, 1, 3, 16, [40, 7], block_size=4, seed=5)
    int2 = random_int2_store(2, 16, [0, 0], window=4)
    assert torch.allclose(mixed_decode_attention_torch(*_fp_args(fp), *_int2_args(int2), None),
                          paged_decode_attention_torch(*_fp_args(fp), None))


def test_bad_stores_raise_clear_errors():
    store = random_paged_store(1, 2, 1, 16, [3, 20], block_size=4)
    args = _fp_args(store)
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention_torch(args[0], args[1], args[2], args[3].long(), args[4], None)
    too_long = torch.tensor([3, 10_000], dtype=torch.int32)
    with pytest.raises(ValueError, match="exceeds the table capacity"):
        paged_decode_attention_torch(*args[:4], too_long, None)
    outside = args[3].clone()
    outside[1, 0] = 999
    with pytest.raises(ValueError, match="outside the pool"):
        paged_decode_attention_torch(args[0], args[1], args[2], outside, args[4], None)
    with pytest.raises(ValueError, match="multiple of"):
        paged_decode_attention_torch(torch.zeros(1, 3, 16), *args[1:], None)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode_attention_torch(args[0], torch.zeros(3, 6, 16), torch.zeros(3, 6, 16), *args[3:], None)
    int2 = random_int2_store(2, 16, [1, 2], window=4)
    bad = _int2_args(int2)
    bad[1] = bad[1].float()  # key_scale must be fp16
    with pytest.raises(ValueError, match="key_scale"):
        mixed_decode_attention_torch(*args, *bad, None)
    bad = _int2_args(int2)
    bad[6] = bad[6].clone()
    bad[6][1, 1] = 50  # row 1's second window points past the window pool
    with pytest.raises(ValueError, match="int2_table points outside the pool"):
        mixed_decode_attention_torch(*args, *bad, None)
    bad = _int2_args(int2)
    bad[7] = torch.tensor([1, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match="int2_counts entry 9 exceeds"):
        mixed_decode_attention_torch(*args, *bad, None)


def test_dispatcher_chooses_and_fails_closed(monkeypatch):
    store = random_paged_store(1, 2, 3, 16, [5, 9], block_size=4)
    args = _fp_args(store)
    assert dispatch.resolve_backend("auto", torch.device("cpu")) == "torch"
    assert torch.equal(dispatch.paged_decode_attention(*args, None), paged_decode_attention_torch(*args, None))
    with pytest.raises(ValueError, match="unknown attention backend"):
        dispatch.paged_decode_attention(*args, None, backend="cuda")
    monkeypatch.setattr(dispatch, "_triton_import_error", lambda: "ImportError: No module named 'triton'")
    with pytest.raises(RuntimeError, match="not importable"):
        dispatch.paged_decode_attention(*args, None, backend="triton")
    assert dispatch.resolve_backend("auto", torch.device("cuda")) == "torch"  # auto never fails


def test_mixed_weights_are_the_softmax_of_mixed_attention():
    from vlm_kv.kernels.int2 import dequantize_values
    from vlm_kv.kernels.paged_torch import mixed_attention_weights_torch

    fp = random_paged_store(2, 2, 3, 16, [0, 9, 0, 40], block_size=8, seed=6)
    int2 = random_int2_store(4, 16, [0, 3, 2, 1], window=4)
    fp_w, q_w = mixed_attention_weights_torch(*_fp_args(fp), *_int2_args(int2), None)
    assert fp_w.shape == (2, 6, 40) and q_w.shape == (2, 6, 3, 4)
    total = fp_w.sum(-1) + q_w.sum((-1, -2))
    assert torch.allclose(total[0, :3], torch.zeros(3)) and torch.allclose(total[0, 3:], torch.ones(3))
    assert torch.allclose(total[1], torch.ones(6))
    assert bool((fp_w[0, 3:, 9:] == 0).all()) and bool((q_w[1, 3:, 1:] == 0).all())  # past lengths / counts
    # weights times the entries' values give the attention output (row 3 = batch 1, kv head 1)
    out = mixed_decode_attention_torch(*_fp_args(fp), *_int2_args(int2), None)
    bs = 8
    fp_values = torch.stack([fp["value_pool"][int(fp["block_table"][3, i // bs]), i % bs] for i in range(40)])
    win = int(int2["int2_table"][3, 0])
    q_values = dequantize_values(int2["value_codes"][win], int2["value_scale"][win], int2["value_zero"][win])
    expected = fp_w[1, 3:, :40] @ fp_values + q_w[1, 3:, 0] @ q_values
    assert torch.allclose(out[1, 3:], expected, atol=1e-5)


def test_without_triton_auto_uses_torch_and_triton_raises(monkeypatch):
    """A CPU install without triton: nothing imports it, "auto" works, "triton" fails closed."""
    import sys

    store = random_paged_store(1, 2, 3, 16, [5, 9], block_size=4)
    args = _fp_args(store)
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton -> ImportError
    monkeypatch.setitem(sys.modules, "vlm_kv.kernels.paged_triton", None)
    dispatch._triton_import_error.cache_clear()
    try:
        assert not dispatch.triton_available()
        assert torch.equal(dispatch.paged_decode_attention(*args, None), paged_decode_attention_torch(*args, None))
        with pytest.raises(RuntimeError, match="triton is not importable"):
            dispatch.paged_decode_attention(*args, None, backend="triton")
    finally:
        dispatch._triton_import_error.cache_clear()
