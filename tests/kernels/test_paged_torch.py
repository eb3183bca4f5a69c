from dataclasses import replace

import pytest
import torch

from kernel_stores import int2_source, naive_decode, paged_source, random_int2_store, random_paged_store
from vlm_kv.kernels import dispatch
from vlm_kv.kernels.int2 import hadamard_basis
from vlm_kv.kernels.paged_torch import gather_int2_rows, paged_decode_attention_torch
from vlm_kv.kernels.sources import PagedSource, launch_plan

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_reference_equals_row_by_row_sdpa(group, dtype):
    store = random_paged_store(2, 2, group, 32, [0, 5, 300, 17], block_size=16, dtype=dtype)
    out = paged_decode_attention_torch(store["query"], [paged_source(store)])
    assert out.shape == (2, 2 * group, 32) and out.dtype == dtype
    assert torch.allclose(out.float(), naive_decode(store), **TOL[dtype])
    assert bool((out[0, :group] == 0).all())  # empty row gives zeros


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_reference_equals_sdpa_over_dequantized_entries(group, dtype):
    fp = random_paged_store(2, 2, group, 32, [0, 9, 0, 120], block_size=8, dtype=dtype, seed=4)
    int2 = random_int2_store(4, 32, [0, 3, 5, 12], window=8)
    out = paged_decode_attention_torch(fp["query"], [paged_source(fp), int2_source(int2)], 0.3)
    assert torch.allclose(out.float(), naive_decode(fp, int2, scaling=0.3), **TOL[dtype])
    assert bool((out[0, :group] == 0).all())  # no FP and no INT2 entries
    assert bool((out[1, :group] != 0).any())  # INT2 only


def test_mixed_without_windows_equals_paged():
    fp = random_paged_store(2, 1, 3, 16, [40, 7], block_size=4, seed=5)
    int2 = random_int2_store(2, 16, [0, 0], window=4)
    assert torch.allclose(paged_decode_attention_torch(fp["query"], [paged_source(fp), int2_source(int2)]),
                          paged_decode_attention_torch(fp["query"], [paged_source(fp)]))


def test_bad_stores_raise_clear_errors():
    store = random_paged_store(1, 2, 1, 16, [3, 20], block_size=4)
    query, fp = store["query"], paged_source(store)

    def decode(*sources):
        return paged_decode_attention_torch(query, list(sources))

    with pytest.raises(ValueError, match="int32"):
        decode(replace(fp, block_table=fp.block_table.long()))
    with pytest.raises(ValueError, match="exceeds the table capacity"):
        decode(replace(fp, lengths=torch.tensor([3, 10_000], dtype=torch.int32)))
    outside = fp.block_table.clone()
    outside[1, 0] = 999
    with pytest.raises(ValueError, match="outside the pool"):
        decode(replace(fp, block_table=outside))
    with pytest.raises(ValueError, match="multiple of"):
        paged_decode_attention_torch(torch.zeros(1, 3, 16), [fp])
    with pytest.raises(ValueError, match="power of two"):
        decode(replace(fp, key_pool=torch.zeros(3, 6, 16), value_pool=torch.zeros(3, 6, 16)))
    int2 = int2_source(random_int2_store(2, 16, [1, 2], window=4))
    with pytest.raises(ValueError, match="key_scale"):
        decode(fp, replace(int2, key_scale=int2.key_scale.float()))  # with an fp16 key_zero
    table = int2.table.clone()
    table[1, 1] = 50  # row 1's second window points past the window pool
    with pytest.raises(ValueError, match="Int2Source.table points outside the pool"):
        decode(fp, replace(int2, table=table))
    with pytest.raises(ValueError, match="Int2Source.counts entry 9 exceeds"):
        decode(fp, replace(int2, counts=torch.tensor([1, 9], dtype=torch.int32)))
    with pytest.raises(ValueError, match="key_basis must be"):
        decode(fp, replace(int2, key_basis=torch.eye(8)))
    with pytest.raises(ValueError, match="share their rows"):  # 4 query heads: 2 or 4 kv heads would both fit
        paged_decode_attention_torch(torch.zeros(1, 4, 16), [fp, PagedSource.empty(4, 16, torch.float32, query.device)])
    with pytest.raises(ValueError, match="at least one source"):
        decode()
    with pytest.raises(TypeError, match="sequence"):
        paged_decode_attention_torch(query, fp)


def test_launch_plan_reads_channel_windows_with_the_paged_source_before_them():
    fp = paged_source(random_paged_store(1, 2, 1, 16, [3, 20], block_size=4))
    tail = paged_source(random_paged_store(1, 2, 1, 16, [1, 1], block_size=1, seed=2))
    int2 = int2_source(random_int2_store(2, 16, [1, 2], window=4))
    query = torch.zeros(1, 2, 16)
    plan = launch_plan(query, [fp, int2, tail])
    assert [(g.fp is fp, g.int2 is int2) for g in plan[:1]] == [(True, True)] and plan[1].fp is tail
    rotated = replace(int2, key_basis=torch.eye(16))
    plan = launch_plan(query, [fp, rotated, tail])  # a rotated source: its own launch, beside nothing
    assert len(plan) == 3 and plan[0].int2 is None and plan[1].int2 is rotated and plan[1].fp.key_pool.numel() == 0
    assert plan[1].fp.key_pool.dtype == fp.key_pool.dtype
    plan = launch_plan(query, [int2, fp, int2, int2])
    assert [(g.fp.key_pool.numel() == 0, g.int2 is not None) for g in plan] == [(True, True), (False, True), (True, True)]


@pytest.mark.parametrize("basis", ["both", "keys"])
def test_windows_in_a_rotated_basis_attend_as_the_windows_rotated_back(basis):
    """The reference rotates windows quantized in a basis back: the same as quantizing the rotated
    entries' dequantized values in the channel basis would give, up to float error."""
    fp = random_paged_store(2, 2, 3, 32, [5, 20, 0, 40], block_size=8, seed=4)
    int2 = int2_source(random_int2_store(4, 32, [3, 0, 2, 5], window=8))
    h = hadamard_basis(32)
    rotated = replace(int2, key_basis=h, value_basis=h if basis == "both" else None)
    out = paged_decode_attention_torch(fp["query"], [paged_source(fp), rotated], 0.3)
    # the same windows, their dequantized entries rotated back and attended as plain FP pages
    keys, values, valid = gather_int2_rows(int2)
    keys = keys @ h.T
    values = values @ h.T if basis == "both" else values
    counts = valid.sum(1).to(torch.int32)
    pages = PagedSource(keys.reshape(-1, 1, 32).contiguous(), values.reshape(-1, 1, 32).contiguous(),
                        (torch.arange(4)[:, None] * keys.shape[1] + torch.arange(keys.shape[1])).to(torch.int32), counts)
    want = paged_decode_attention_torch(fp["query"], [paged_source(fp), pages], 0.3)
    assert torch.allclose(out, want, atol=1e-6)


def test_dispatcher_chooses_and_fails_closed(monkeypatch):
    store = random_paged_store(1, 2, 3, 16, [5, 9], block_size=4)
    query, sources = store["query"], [paged_source(store)]
    assert dispatch.resolve_backend("auto", torch.device("cpu")) == "torch"
    assert torch.equal(dispatch.paged_decode_attention(query, sources), paged_decode_attention_torch(query, sources))
    with pytest.raises(ValueError, match="unknown attention backend"):
        dispatch.paged_decode_attention(query, sources, backend="cuda")
    monkeypatch.setattr(dispatch, "_triton_import_error", lambda: "ImportError: No module named 'triton'")
    with pytest.raises(RuntimeError, match="not importable"):
        dispatch.paged_decode_attention(query, sources, backend="triton")
    assert dispatch.resolve_backend("auto", torch.device("cuda")) == "torch"  # auto never fails


def test_mixed_weights_are_the_softmax_of_mixed_attention():
    from vlm_kv.kernels.int2 import dequantize_values
    from vlm_kv.kernels.paged_torch import mixed_attention_weights_torch

    fp = random_paged_store(2, 2, 3, 16, [0, 9, 0, 40], block_size=8, seed=6)
    int2 = random_int2_store(4, 16, [0, 3, 2, 1], window=4)
    fp_w, q_w = mixed_attention_weights_torch(fp["query"], paged_source(fp), int2_source(int2))
    assert fp_w.shape == (2, 6, 40) and q_w.shape == (2, 6, 3, 4)
    total = fp_w.sum(-1) + q_w.sum((-1, -2))
    assert torch.allclose(total[0, :3], torch.zeros(3)) and torch.allclose(total[0, 3:], torch.ones(3))
    assert torch.allclose(total[1], torch.ones(6))
    assert bool((fp_w[0, 3:, 9:] == 0).all()) and bool((q_w[1, 3:, 1:] == 0).all())  # past lengths / counts
    # weights times the entries' values give the attention output (row 3 = batch 1, kv head 1)
    out = paged_decode_attention_torch(fp["query"], [paged_source(fp), int2_source(int2)])
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
    query, sources = store["query"], [paged_source(store)]
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton -> ImportError
    monkeypatch.setitem(sys.modules, "vlm_kv.kernels.paged_triton", None)
    dispatch._triton_import_error.cache_clear()
    try:
        assert not dispatch.triton_available()
        assert torch.equal(dispatch.paged_decode_attention(query, sources), paged_decode_attention_torch(query, sources))
        with pytest.raises(RuntimeError, match="triton is not importable"):
            dispatch.paged_decode_attention(query, sources, backend="triton")
    finally:
        dispatch._triton_import_error.cache_clear()
