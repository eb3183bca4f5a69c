"""Prefill over a compressed paged store: the flash-attn varlen packing, checked on CPU.

flash-attn itself needs CUDA; here its arguments are fed to ``varlen_attention_reference``
(flash-attn's semantics written out in PyTorch) and compared with the paged PyTorch path.
"""

import pytest
import torch
import torch.nn.functional as F

from kernel_stores import FP_KEYS, random_paged_store
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
    return query, [store[k] for k in FP_KEYS[1:]]


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_packed_varlen_equals_paged_torch(group, dtype, causal):
    query, store = _prefill_store(group, dtype, [6, 45, 130, 9], q_len=6, seed=group)
    pack = pack_paged_prefill(query, *store, causal=causal)
    out = varlen_attention_reference(pack.query, pack.key, pack.value, pack.cu_seqlens_q, pack.cu_seqlens_k, 0.25, causal)
    unpacked = unpack_prefill_output(out, 2, 2 * group, 6)
    ref = paged_prefill_attention_torch(query, *store, 0.25, causal=causal)
    assert unpacked.shape == query.shape
    assert torch.allclose(unpacked.float(), ref.float(), **TOL[dtype])


def test_cu_seqlens_and_shapes():
    query, store = _prefill_store(3, torch.float32, [6, 45, 130, 9], q_len=6)
    pack = pack_paged_prefill(query, *store)
    assert pack.cu_seqlens_q.tolist() == [0, 6, 12, 18, 24] and pack.cu_seqlens_q.dtype == torch.int32
    assert pack.cu_seqlens_k.tolist() == [0, 6, 51, 181, 190] and pack.cu_seqlens_k.dtype == torch.int32
    assert (pack.max_seqlen_q, pack.max_seqlen_k) == (6, 130)
    assert pack.query.shape == (24, 3, 32) and pack.key.shape == (190, 1, 32) and pack.value.shape == (190, 1, 32)
    # row 2 (batch 1, kv head 0) starts at packed key 51 and its query heads are 6..8 of batch 1
    pool, table = store[0], store[2]
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
    out = paged_prefill_attention(query, key_pool, value_pool, table, lengths, None)
    assert torch.allclose(out, dense, atol=1e-5, rtol=1e-4)
    # the last 5 queries against the same rows (a later chunk of the prompt)
    tail = paged_prefill_attention(query[:, :, -5:].contiguous(), key_pool, value_pool, table, lengths, None)
    assert torch.allclose(tail, dense[:, :, -5:], atol=1e-5, rtol=1e-4)


def test_prefill_bad_input_raises():
    query, store = _prefill_store(1, torch.float32, [6, 45, 3, 9], q_len=6)
    with pytest.raises(ValueError, match="last entries"):
        paged_prefill_attention_torch(query, *store, None, causal=True)
    with pytest.raises(RuntimeError, match="flash-attn"):
        paged_prefill_attention(query, *store, None, causal=False, backend="flash")
    with pytest.raises(ValueError, match="unknown prefill backend"):
        paged_prefill_attention(query, *store, None, backend="triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash-attn runs on CUDA only (run by scripts/gpu_check.sh)")
@pytest.mark.parametrize("causal", [True, False])
def test_flash_prefill_equals_torch_on_cuda(causal):
    from vlm_kv.kernels.varlen_prefill import flash_attn_available

    if not flash_attn_available():
        pytest.skip("flash-attn is not installed on this CUDA machine")
    query, store = _prefill_store(3, torch.bfloat16, [6, 45, 130, 9], q_len=6, seed=11)
    query, store = query.cuda(), [t.cuda() for t in store]
    out = paged_prefill_attention(query, *store, 0.25, causal=causal, backend="flash")
    ref = paged_prefill_attention_torch(query, *store, 0.25, causal=causal)
    assert torch.allclose(out.float(), ref.float(), **TOL[torch.bfloat16])
