"""Prefill attention over a compressed paged cache with flash-attn's varlen kernel (AdaKV flattening).

Each (batch, kv head) row of the store has its own length after eviction, so it becomes one
varlen sequence: its keys/values are packed end to end as ``[total_k, 1, D]`` (one kv head),
and the queries of its ``g`` query heads as ``[rows * Q, g, D]`` (flash-attn's GQA maps the g
query heads onto the single kv head). ``cu_seqlens_k`` is the running sum of the row lengths,
``cu_seqlens_q`` steps by Q.

Causal prefill: the row's last Q FP entries must be the Q new tokens, in order, with everything
kept from earlier before them (append the chunk to the store, then attend). INT2 windows, when
given, are history: they are packed before the row's FP entries, so every query sees them. flash-attn aligns
its causal mask to the bottom right (query i sees keys ``j <= i + len - Q``), which is then
exactly "kept history plus the new tokens up to itself".

The packing, unpacking and cu_seqlens logic is pure PyTorch and tested on CPU against
``varlen_attention_reference`` (flash-attn's semantics written out); flash-attn itself only
runs on CUDA and was not run here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from vlm_kv.kernels.int2 import dequantize_keys, dequantize_values
from vlm_kv.kernels.layout import PagedShape, check_int2_store, check_paged_store
from vlm_kv.kernels.paged_torch import gather_int2_rows, gather_paged_rows
from vlm_kv.kernels.sources import Int2Source, PagedSource


@dataclass
class VarlenPack:
    """Arguments of ``flash_attn_varlen_func`` for one layer's prefill."""

    query: torch.Tensor  # [rows * Q, g, D]
    key: torch.Tensor  # [total_k, 1, D]
    value: torch.Tensor  # [total_k, 1, D]
    cu_seqlens_q: torch.Tensor  # [rows + 1] int32
    cu_seqlens_k: torch.Tensor  # [rows + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int


def _check_prefill(query: torch.Tensor, fp: PagedSource, causal: bool, validate: bool) -> tuple[PagedShape, int]:
    if query.dim() != 4:
        raise ValueError(f"prefill query must be [batch, query_heads, q_len, head_dim], got {tuple(query.shape)}")
    shape = check_paged_store(query[:, :, 0], fp, validate)
    lengths = fp.lengths
    q_len = query.shape[2]
    if causal and validate and lengths.numel() and int(lengths.min()) < q_len:
        raise ValueError(
            f"causal prefill needs the {q_len} new tokens stored as each row's last entries, but a row holds only "
            f"{int(lengths.min())} entries"
        )
    return shape, q_len


def paged_entry_index(block_table: torch.Tensor, lengths: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat pool slot (block * block_size + slot) of every held entry, rows end to end: [sum(lengths)] int64."""
    rows = block_table.shape[0]
    counts = lengths.long()
    row_ids = torch.repeat_interleave(torch.arange(rows, device=block_table.device), counts)
    starts = torch.cumsum(counts, 0) - counts
    within = torch.arange(row_ids.numel(), device=block_table.device) - starts[row_ids]
    blocks = block_table[row_ids, within // block_size].long()
    return blocks * block_size + within % block_size


def _check_int2(shape: PagedShape, query: torch.Tensor, int2: Int2Source | None, validate: bool) -> int:
    if int2 is None:
        return 0
    if int2.slot_mask is not None or int2.rotated:
        raise ValueError("prefill reads whole INT2 windows in the channel basis: no slot_mask, key_basis or value_basis")
    return check_int2_store(shape, query.device, int2, validate)


def _int2_rows_packed(int2: Int2Source, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every held window dequantized, rows end to end: (keys, values [n * w, D], row of each token,
    index of each token within its row)."""
    key_codes, key_scale, key_zero, value_codes, value_scale, value_zero = int2.pools()
    table, counts = int2.table, int2.counts
    rows, w = table.shape[0], key_codes.shape[1]
    per_row = counts.long()
    win_row = torch.repeat_interleave(torch.arange(rows, device=table.device), per_row)
    starts = torch.cumsum(per_row, 0) - per_row
    win_col = torch.arange(win_row.numel(), device=table.device) - starts[win_row]
    ids = table[win_row, win_col].long()
    d = key_codes.shape[2] * 4
    keys = dequantize_keys(key_codes.index_select(0, ids), key_scale.index_select(0, ids), key_zero.index_select(0, ids))
    values = dequantize_values(value_codes.index_select(0, ids), value_scale.index_select(0, ids),
                               value_zero.index_select(0, ids))
    token_row = win_row.repeat_interleave(w)
    token_within = (win_col[:, None] * w + torch.arange(w, device=table.device)[None, :]).reshape(-1)
    return keys.reshape(-1, d).to(dtype), values.reshape(-1, d).to(dtype), token_row, token_within


def pack_paged_prefill(
    query: torch.Tensor,
    fp: PagedSource,
    int2: Int2Source | None = None,
    causal: bool = True,
    validate: bool = True,
) -> VarlenPack:
    """Packed q/k/v and cu_seqlens for prefill queries [B, Hq, Q, D] over the paged store ``fp``.

    With ``int2`` (whole windows in the channel basis) each row's sequence is its dequantized INT2
    windows (in table order, in the query dtype) followed by its FP entries: the windows are
    history, so bottom-right causal masking lets every query see them.
    """
    shape, q_len = _check_prefill(query, fp, causal, validate)
    w = _check_int2(shape, query, int2, validate)
    key_pool, value_pool, block_table, lengths = fp.key_pool, fp.value_pool, fp.block_table, fp.lengths
    rows, g, d = shape.rows, shape.group, shape.head_dim
    dev = query.device
    packed_q = query.reshape(shape.batch, shape.num_kv_heads, g, q_len, d).permute(0, 1, 3, 2, 4)
    packed_q = packed_q.reshape(rows * q_len, g, d).contiguous()
    index = paged_entry_index(block_table, lengths, shape.block_size)
    fp_key = key_pool.view(-1, d).index_select(0, index)
    fp_value = value_pool.view(-1, d).index_select(0, index)
    int2_tokens = int2.counts.long() * w if int2 is not None else torch.zeros(rows, dtype=torch.long, device=dev)
    per_row = lengths.long() + int2_tokens
    cu_k = torch.zeros(rows + 1, device=dev, dtype=torch.int32)
    cu_k[1:] = torch.cumsum(per_row, 0).to(torch.int32)
    if int2 is None:
        key, value = fp_key, fp_value
    else:
        q_key, q_value, token_row, token_within = _int2_rows_packed(int2, key_pool.dtype)
        total = int(cu_k[-1])
        key = key_pool.new_empty(total, d)
        value = value_pool.new_empty(total, d)
        row_start = cu_k[:-1].long()
        key.index_copy_(0, row_start[token_row] + token_within, q_key)
        value.index_copy_(0, row_start[token_row] + token_within, q_value)
        fp_row = torch.repeat_interleave(torch.arange(rows, device=dev), lengths.long())
        fp_within = torch.arange(fp_row.numel(), device=dev) - (torch.cumsum(lengths.long(), 0) - lengths.long())[fp_row]
        fp_dest = row_start[fp_row] + int2_tokens[fp_row] + fp_within
        key.index_copy_(0, fp_dest, fp_key)
        value.index_copy_(0, fp_dest, fp_value)
    cu_q = torch.arange(rows + 1, device=dev, dtype=torch.int32) * q_len
    max_k = int(per_row.max()) if rows else 0
    return VarlenPack(packed_q, key.unsqueeze(1), value.unsqueeze(1), cu_q, cu_k, q_len, max_k)


def unpack_prefill_output(out: torch.Tensor, batch: int, num_query_heads: int, q_len: int) -> torch.Tensor:
    """[rows * Q, g, D] varlen output -> [B, Hq, Q, D]."""
    total, g, d = out.shape
    h = num_query_heads // g
    if total != batch * h * q_len:
        raise ValueError(f"varlen output has {total} query rows, expected {batch} * {h} * {q_len}")
    return out.view(batch, h, q_len, g, d).permute(0, 1, 3, 2, 4).reshape(batch, num_query_heads, q_len, d)


def varlen_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    softmax_scale: float | None,
    causal: bool,
) -> torch.Tensor:
    """flash_attn_varlen_func's semantics in plain PyTorch, one sequence at a time (tests only).

    q [total_q, Hq, D], k/v [total_k, Hk, D] with Hq a multiple of Hk (query head i uses kv
    head i // (Hq // Hk)); causal masks are aligned to the bottom right; an empty key sequence
    gives zeros.
    """
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    rep = q.shape[1] // k.shape[1]
    for i in range(len(bounds_q) - 1):
        q0, q1, k0, k1 = bounds_q[i], bounds_q[i + 1], bounds_k[i], bounds_k[i + 1]
        if q1 == q0 or k1 == k0:
            continue
        qs = q[q0:q1].transpose(0, 1).float()
        ks = k[k0:k1].transpose(0, 1).float().repeat_interleave(rep, dim=0)
        vs = v[k0:k1].transpose(0, 1).float().repeat_interleave(rep, dim=0)
        mask = None
        if causal:
            lq, lk = q1 - q0, k1 - k0
            mask = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        out[q0:q1] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale).transpose(0, 1)
    return out.to(q.dtype)


def paged_prefill_attention_torch(
    query: torch.Tensor,
    fp: PagedSource,
    int2: Int2Source | None = None,
    *,
    scaling: float | None = None,
    causal: bool = True,
    validate: bool = True,
    chunk: int = 256,
) -> torch.Tensor:
    """Prefill queries [B, Hq, Q, D] over the paged store (and INT2 windows) in PyTorch; returns [B, Hq, Q, D].

    Same masking as the flash path: FP entries bottom-right causal per row, INT2 windows (history)
    visible to every query. Chunked over queries so memory stays O(chunk * longest row).
    """
    shape, q_len = _check_prefill(query, fp, causal, validate)
    _check_int2(shape, query, int2, validate)
    lengths = fp.lengths
    rows, g, d = shape.rows, shape.group, shape.head_dim
    scale = scaling if scaling is not None else d ** -0.5
    keys, values, valid = gather_paged_rows(fp)
    keys, values = keys.float(), values.float()
    fp_cols = keys.shape[1]
    if int2 is not None:
        q_keys, q_values, q_valid = gather_int2_rows(int2)
        keys, values = torch.cat([keys, q_keys], dim=1), torch.cat([values, q_values], dim=1)
        valid = torch.cat([valid, q_valid], dim=1)
    keys_t = keys.transpose(1, 2)
    q = query.reshape(rows, g, q_len, d).float()
    cols = torch.arange(keys.shape[1], device=query.device)
    out = torch.zeros(rows, g, q_len, d, dtype=torch.float32, device=query.device)
    for start in range(0, q_len, chunk):
        stop = min(start + chunk, q_len)
        visible = valid[:, None, :].expand(rows, stop - start, keys.shape[1])
        if causal:
            last = torch.arange(start, stop, device=query.device)[None, :, None] + (lengths.long() - q_len)[:, None, None]
            visible = visible & ((cols[None, None, :] <= last) | (cols[None, None, :] >= fp_cols))
        logits = torch.matmul(q[:, :, start:stop], keys_t[:, None]) * scale  # [rows, g, c, L]
        logits = logits.masked_fill(~visible[:, None], float("-inf"))
        probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)  # a query that sees nothing: zeros
        out[:, :, start:stop] = torch.matmul(probs, values[:, None])
    return out.view(shape.batch, shape.num_query_heads, q_len, d).to(query.dtype)


@lru_cache(maxsize=None)
def _flash_varlen():
    try:
        return importlib.import_module("flash_attn").flash_attn_varlen_func
    except Exception:  # ImportError, or a wheel built for another torch/CUDA
        return None


def flash_attn_available() -> bool:
    return _flash_varlen() is not None


def paged_prefill_attention_flash(
    query: torch.Tensor,
    fp: PagedSource,
    int2: Int2Source | None = None,
    *,
    scaling: float | None = None,
    causal: bool = True,
    validate: bool = True,
) -> torch.Tensor:
    """Prefill queries [B, Hq, Q, D] over the paged store (and INT2 windows, dequantized into the
    packed keys) with flash_attn_varlen_func (CUDA, fp16/bf16)."""
    fn = _flash_varlen()
    if fn is None:
        raise RuntimeError("flash-attn is not importable; install flash-attn or use backend='torch'")
    if query.device.type != "cuda":
        raise RuntimeError(f"flash-attn needs CUDA tensors, got {query.device}")
    if query.dtype not in (torch.float16, torch.bfloat16) or fp.key_pool.dtype != query.dtype:
        raise ValueError(f"flash-attn needs fp16/bf16 query and pools of the same dtype, got {query.dtype}/{fp.key_pool.dtype}")
    pack = pack_paged_prefill(query, fp, int2, causal, validate)
    out = fn(
        pack.query, pack.key, pack.value,
        cu_seqlens_q=pack.cu_seqlens_q, cu_seqlens_k=pack.cu_seqlens_k,
        max_seqlen_q=pack.max_seqlen_q, max_seqlen_k=max(pack.max_seqlen_k, 1),
        dropout_p=0.0, softmax_scale=scaling, causal=causal,
    )
    result = unpack_prefill_output(out, query.shape[0], query.shape[1], query.shape[2])
    held = fp.lengths if int2 is None else fp.lengths + int2.counts
    empty = (held == 0).view(query.shape[0], -1)  # [B, H]: no keys, flash's output is undefined
    g = query.shape[1] // empty.shape[1]
    return result.masked_fill(empty.repeat_interleave(g, dim=1)[:, :, None, None], 0)


def paged_prefill_attention(
    query: torch.Tensor,
    fp: PagedSource,
    int2: Int2Source | None = None,
    *,
    scaling: float | None = None,
    causal: bool = True,
    backend: str = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """Prefill attention of ``query`` [B, Hq, Q, D] over ``fp`` with backend "auto" (flash on CUDA
    fp16/bf16 when importable), "torch" or "flash"; returns [B, Hq, Q, D].

    ``int2``: optional whole windows in the channel basis (no slot mask, no basis); the INT2
    windows are history, visible to every query."""
    if backend not in ("auto", "torch", "flash"):
        raise ValueError(f"unknown prefill backend {backend!r}; choose 'auto', 'torch' or 'flash'")
    use_flash = backend == "flash" or (
        backend == "auto" and query.device.type == "cuda" and query.dtype in (torch.float16, torch.bfloat16)
        and flash_attn_available()
    )
    if use_flash:
        return paged_prefill_attention_flash(query, fp, int2, scaling=scaling, causal=causal, validate=validate)
    return paged_prefill_attention_torch(query, fp, int2, scaling=scaling, causal=causal, validate=validate)
