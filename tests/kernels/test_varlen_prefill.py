"""Prefill over a compressed paged store: the flash-attn varlen packing, checked on CPU.

flash-attn itself needs CUDA; here its arguments are fed to ``varlen_attention_reference``
(flash-attn's semantics written out in PyTorch) and compared with the paged PyTorch path.
"""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from kernel_stores import paged_source, random_paged_store
from vlm_kv.kernels.sources import PagedSource
from vlm_kv.kernels.varlen_prefill import (
    pack_paged_prefill,
    paged_prefill_attention,
    paged_prefill_attention_torch,
    unpack_prefill_output,
    varlen_attention_reference,
)

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _prefill_store(group, dtype, lengths, q_len, seed=0):
    store = random_paged_store(2, 2, group, 32, lengths, block_size=8, dtype=dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    query = torch.randn(2, 2 * group, q_len, 32, generator=gen).to(dtype)
    return query, paged_source(store)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_packed_varlen_equals_paged_torch(group, dtype, causal):
    query, store = _prefill_store(group, dtype, [6, 45, 130, 9], q_len=6, seed=group)
    pack = pack_paged_prefill(query, store, causal=causal)
    out = varlen_attention_reference(pack.query, pack.key, pack.value, pack.cu_seqlens_q, pack.cu_seqlens_k, 0.25, causal)
    unpacked = unpack_prefill_output(out, 2, 2 * group, 6)
    ref = paged_prefill_attention_torch(query, store, scaling=0.25, causal=causal)
    assert unpacked.shape == query.shape
    assert torch.allclose(unpacked.float(), ref.float(), **TOL[dtype])


def test_cu_seqlens_and_shapes():
    query, store = _prefill_store(3, torch.float32, [6, 45, 130, 9], q_len=6)
    pack = pack_paged_prefill(query, store)
    assert pack.cu_seqlens_q.tolist() == [0, 6, 12, 18, 24] and pack.cu_seqlens_q.dtype == torch.int32
    assert pack.cu_seqlens_k.tolist() == [0, 6, 51, 181, 190] and pack.cu_seqlens_k.dtype == torch.int32
    assert (pack.max_seqlen_q, pack.max_seqlen_k) == (6, 130)
    assert pack.query.shape == (24, 3, 32) and pack.key.shape == (190, 1, 32) and pack.value.shape == (190, 1, 32)
    # row 2 (batch 1, kv head 0) starts at packed key 51 and its query heads are 6..8 of batch 1
    pool, table = store.key_pool, store.block_table
    assert torch.equal(pack.key[51, 0], pool[int(table[2, 0]), 0])
    assert torch.equal(pack.key[51 + 129, 0], pool[int(table[2, 129 // 8]), 129 % 8])
    assert torch.equal(pack.query[12:18], query[1, 0:3].transpose(0, 1))


@pytest.mark.parametrize("group", [1, 3])
def test_causal_prefill_without_eviction_equals_dense_causal_sdpa(group):
    """Each row holding the whole prompt: the paged path must be plain causal attention."""
    t, h, d, bs = 37, 2, 16, 8
    gen = torch.Generator().manual_seed(5)
    keys = torch.randn(2, h, t, d, generator=gen)
    values = torch.randn(2, h, t, d, generator=gen)
    query = torch.randn(2, h * group, t, d, generator=gen)
    blocks = -(-t // bs)
    order = torch.randperm(2 * h * blocks, generator=gen)
    table = order.view(2 * h, blocks).to(torch.int32)
    key_pool = torch.zeros(2 * h * blocks, bs, d)
    value_pool = torch.zeros_like(key_pool)
    for r in range(2 * h):
        for i in range(t):
            key_pool[table[r, i // bs], i % bs] = keys.view(2 * h, t, d)[r, i]
            value_pool[table[r, i // bs], i % bs] = values.view(2 * h, t, d)[r, i]
    lengths = torch.full((2 * h,), t, dtype=torch.int32)
    dense = F.scaled_dot_product_attention(query, keys, values, is_causal=True, enable_gqa=group > 1)
    pages = PagedSource(key_pool, value_pool, table, lengths)
    out = paged_prefill_attention(query, pages)
    assert torch.allclose(out, dense, atol=1e-5, rtol=1e-4)
    # the last 5 queries against the same rows (a later chunk of the prompt)
    tail = paged_prefill_attention(query[:, :, -5:].contiguous(), pages)
    assert torch.allclose(tail, dense[:, :, -5:], atol=1e-5, rtol=1e-4)


def test_prefill_bad_input_raises():
    query, store = _prefill_store(1, torch.float32, [6, 45, 3, 9], q_len=6)
    with pytest.raises(ValueError, match="last entries"):
        paged_prefill_attention_torch(query, store, causal=True)
    with pytest.raises(RuntimeError, match="flash-attn"):
        paged_prefill_attention(query, store, causal=False, backend="flash")
    with pytest.raises(ValueError, match="unknown prefill backend"):
        paged_prefill_attention(query, store, backend="triton")
    int2 = _int2_windows(4, [0, 3, 1, 5])
    with pytest.raises(ValueError, match="whole INT2 windows in the channel basis"):
        paged_prefill_attention_torch(query, store, replace(int2, slot_mask=torch.ones(int2.key_codes.shape[:2],
                                                                                       dtype=torch.bool)), causal=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash-attn runs on CUDA only (run by scripts/gpu_check.sh)")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("with_int2", [False, True])
def test_flash_prefill_equals_torch_on_cuda(causal, with_int2):
    from vlm_kv.kernels.varlen_prefill import flash_attn_available

    if not flash_attn_available():
        pytest.skip("flash-attn is not installed on this CUDA machine")
    query, store = _prefill_store(3, torch.bfloat16, [6, 45, 130, 9], q_len=6, seed=11)
    query = query.cuda()
    store = PagedSource(store.key_pool.cuda(), store.value_pool.cuda(), store.block_table.cuda(), store.lengths.cuda())
    int2 = _int2_windows(4, [0, 3, 1, 5], device="cuda") if with_int2 else None
    out = paged_prefill_attention(query, store, int2, scaling=0.25, causal=causal, backend="flash")
    ref = paged_prefill_attention_torch(query, store, int2, scaling=0.25, causal=causal)
    tol = dict(atol=6e-2, rtol=2e-2) if with_int2 else TOL[torch.bfloat16]  # see the packed INT2 test
    assert torch.allclose(out.float(), ref.float(), **tol)


def _int2_windows(rows, counts, seed=3, device="cpu"):
    from kernel_stores import int2_source, random_int2_store

    return int2_source(random_int2_store(rows, 32, counts, window=8, seed=seed, device=device))


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_packed_varlen_with_int2_equals_mixed_torch(group, dtype, causal):
    query, store = _prefill_store(group, dtype, [6, 45, 130, 9], q_len=6, seed=group + 4)
    int2 = _int2_windows(4, [0, 3, 1, 5])
    pack = pack_paged_prefill(query, store, int2, causal=causal)
    assert pack.cu_seqlens_k.tolist() == [0, 6, 6 + 45 + 24, 6 + 69 + 138, 6 + 69 + 138 + 49]
    out = varlen_attention_reference(pack.query, pack.key, pack.value, pack.cu_seqlens_q, pack.cu_seqlens_k, 0.25, causal)
    unpacked = unpack_prefill_output(out, 2, 2 * group, 6)
    ref = paged_prefill_attention_torch(query, store, int2, scaling=0.25, causal=causal)
    # flash-attn takes keys in the model dtype, so the packed windows are rounded to bf16 there
    # while the PyTorch path keeps them in float32: keys up to ~15 move by up to 1/32 in bf16.
    tol = TOL[dtype] if dtype == torch.float32 else dict(atol=6e-2, rtol=2e-2)
    assert torch.allclose(unpacked.float(), ref.float(), **tol)


def test_packed_int2_windows_come_first_in_table_order():
    from vlm_kv.kernels.int2 import dequantize_keys

    query, store = _prefill_store(1, torch.float32, [6, 45, 130, 9], q_len=6)
    int2 = _int2_windows(4, [0, 3, 1, 5])
    pack = pack_paged_prefill(query, store, int2)
    row1 = pack.key[6 : 6 + 69, 0]
    for j in range(3):
        win = int(int2.table[1, j])
        assert torch.equal(row1[8 * j : 8 * j + 8], dequantize_keys(int2.key_codes[win], int2.key_scale[win],
                                                                    int2.key_zero[win]))
    pool, table = store.key_pool, store.block_table
    assert torch.equal(row1[24], pool[int(table[1, 0]), 0])  # then the FP entries in order
    assert torch.equal(row1[-1], pool[int(table[1, 44 // 8]), 44 % 8])


@pytest.mark.parametrize("group", [1, 3])
def test_single_query_mixed_prefill_equals_mixed_decode(group):
    """Q = 1 causal prefill (the query's own token is its row's last FP entry) is decode."""
    from vlm_kv.kernels.paged_torch import paged_decode_attention_torch

    fp = random_paged_store(2, 2, group, 32, [1, 45, 130, 9], block_size=8, seed=12)
    int2 = _int2_windows(4, [2, 0, 1, 5], seed=13)
    decode = paged_decode_attention_torch(fp["query"], [paged_source(fp), int2], 0.3)
    prefill = paged_prefill_attention_torch(fp["query"][:, :, None], paged_source(fp), int2, scaling=0.3)
    assert torch.allclose(prefill[:, :, 0], decode, atol=1e-5, rtol=1e-4)
