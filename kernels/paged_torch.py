"""Pure PyTorch decode attention over the paged FP store and the INT2 windows (the reference).

One decode query per (batch, query head) attends over its kv head's row. The row's blocks are
gathered into one [rows, L, D] tensor (L = the longest row rounded up to whole blocks), and
all rows are attended in one masked SDPA call; no Python loop over rows. INT2 windows are
dequantized (float32) and laid after the FP entries of the same row: softmax does not depend on
order, so one softmax covers both tiers. SDPA accumulates the softmax in float32; the output is
cast to the query dtype. A row with no entries gives zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vlm_kv.kernels.int2 import dequantize_keys, dequantize_values
from vlm_kv.kernels.layout import PagedShape, check_int2_store, check_paged_store


def gather_paged_rows(
    key_pool: torch.Tensor, value_pool: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every row's entries, left aligned: (keys, values [rows, L, D], valid [rows, L]) with L the
    longest row rounded up to whole blocks; ``valid`` is False at slots past a row's length."""
    rows = block_table.shape[0]
    block_size, d = key_pool.shape[1], key_pool.shape[2]
    longest = int(lengths.max()) if rows else 0
    cols = -(-longest // block_size)
    # Columns past a row's blocks may hold -1: read block 0 there, the slots are masked anyway.
    ids = block_table[:, :cols].reshape(-1).long().clamp_(min=0)
    # index_select copies whole blocks, much faster than pool[ids] on CPU.
    keys = key_pool.index_select(0, ids).view(rows, cols * block_size, d)
    values = value_pool.index_select(0, ids).view(rows, cols * block_size, d)
    valid = torch.arange(cols * block_size, device=key_pool.device)[None, :] < lengths[:, None]
    return keys, values, valid


def gather_int2_rows(
    key_codes: torch.Tensor,
    key_scale: torch.Tensor,
    key_zero: torch.Tensor,
    value_codes: torch.Tensor,
    value_scale: torch.Tensor,
    value_zero: torch.Tensor,
    int2_table: torch.Tensor,
    int2_counts: torch.Tensor,
    slot_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every row's INT2 windows dequantized (float32): (keys, values [rows, L, D], valid [rows, L]);
    ``slot_mask`` [num_windows, w] marks the attended slots (None: all)."""
    rows = int2_table.shape[0]
    w, d = key_codes.shape[1], key_codes.shape[2] * 4
    most = int(int2_counts.max()) if rows else 0
    ids = int2_table[:, :most].reshape(-1).long().clamp_(min=0)

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t.index_select(0, ids)

    keys = dequantize_keys(pick(key_codes), pick(key_scale), pick(key_zero)).view(rows, most * w, d)
    values = dequantize_values(pick(value_codes), pick(value_scale), pick(value_zero)).view(rows, most * w, d)
    valid = torch.arange(most * w, device=key_codes.device)[None, :] < (int2_counts.long() * w)[:, None]
    if slot_mask is not None:
        valid &= slot_mask.index_select(0, ids).view(rows, most * w)
    return keys, values, valid


def _attend_rows(query: torch.Tensor, shape: PagedShape, keys: torch.Tensor, values: torch.Tensor,
                 valid: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """All rows in one SDPA call: row r is a "batch" entry whose g query heads are its g queries.

    One fused call (softmax accumulated in float32 by SDPA's kernels, also for 16-bit inputs)
    instead of matmul / mask / softmax / matmul: at short rows the per-op overhead is what a
    decode step pays.
    """
    q = query.reshape(shape.rows, 1, shape.group, shape.head_dim).to(keys.dtype)
    out = F.scaled_dot_product_attention(q, keys[:, None], values[:, None], attn_mask=valid[:, None, None, :],
                                         scale=scaling)
    out = out.nan_to_num_(0.0)  # a row with no entries: zeros (older torch versions give NaN)
    return out.view(shape.batch, shape.num_query_heads, shape.head_dim).to(query.dtype)


def paged_decode_attention_torch(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    scaling: float | None,
    validate: bool = True,
) -> torch.Tensor:
    """Decode attention of ``query`` [B, Hq, D] over the paged FP store; returns [B, Hq, D]."""
    shape = check_paged_store(query, key_pool, value_pool, block_table, lengths, validate)
    keys, values, valid = gather_paged_rows(key_pool, value_pool, block_table, lengths)
    return _attend_rows(query, shape, keys, values, valid, scaling)


def mixed_decode_attention_torch(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    key_codes: torch.Tensor,
    key_scale: torch.Tensor,
    key_zero: torch.Tensor,
    value_codes: torch.Tensor,
    value_scale: torch.Tensor,
    value_zero: torch.Tensor,
    int2_table: torch.Tensor,
    int2_counts: torch.Tensor,
    scaling: float | None,
    validate: bool = True,
    slot_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One softmax over each row's FP entries and its dequantized INT2 windows; returns [B, Hq, D]."""
    shape = check_paged_store(query, key_pool, value_pool, block_table, lengths, validate)
    check_int2_store(shape, query.device, key_codes, key_scale, key_zero, value_codes, value_scale, value_zero,
                     int2_table, int2_counts, validate, slot_mask)
    fp_keys, fp_values, fp_valid = gather_paged_rows(key_pool, value_pool, block_table, lengths)
    q_keys, q_values, q_valid = gather_int2_rows(key_codes, key_scale, key_zero, value_codes, value_scale, value_zero,
                                                   int2_table, int2_counts, slot_mask)
    keys = torch.cat([fp_keys.float(), q_keys], dim=1)
    values = torch.cat([fp_values.float(), q_values], dim=1)
    valid = torch.cat([fp_valid, q_valid], dim=1)
    return _attend_rows(query, shape, keys, values, valid, scaling)


def mixed_attention_weights_torch(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    key_codes: torch.Tensor,
    key_scale: torch.Tensor,
    key_zero: torch.Tensor,
    value_codes: torch.Tensor,
    value_scale: torch.Tensor,
    value_zero: torch.Tensor,
    int2_table: torch.Tensor,
    int2_counts: torch.Tensor,
    scaling: float | None,
    validate: bool = True,
    slot_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax weights of ``mixed_decode_attention`` for scorers (fused kernels never produce them).

    Returns float32 ``(fp_weights [B, Hq, L], int2_weights [B, Hq, max_windows_held, w])``:
    ``fp_weights[b, qh, i]`` is the weight of FP entry i of the query head's row (L = longest
    row rounded up to whole blocks, zeros past a row's length) and ``int2_weights[b, qh, j, t]``
    that of token t of the row's j-th INT2 window (``int2_table[r, j]``). Both tiers share one
    softmax, so a row's weights sum to 1 (0 for a row with no entries).
    """
    shape = check_paged_store(query, key_pool, value_pool, block_table, lengths, validate)
    w = check_int2_store(shape, query.device, key_codes, key_scale, key_zero, value_codes, value_scale, value_zero,
                         int2_table, int2_counts, validate, slot_mask)
    fp_keys, _, fp_valid = gather_paged_rows(key_pool, key_pool, block_table, lengths)  # values not needed
    q_keys, _, q_valid = gather_int2_rows(key_codes, key_scale, key_zero, value_codes, value_scale, value_zero,
                                          int2_table, int2_counts, slot_mask)
    keys = torch.cat([fp_keys.float(), q_keys], dim=1)
    valid = torch.cat([fp_valid, q_valid], dim=1)
    scale = scaling if scaling is not None else shape.head_dim ** -0.5
    q = query.reshape(shape.rows, shape.group, shape.head_dim).float() * scale
    logits = torch.bmm(q, keys.transpose(1, 2)).masked_fill_(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)
    probs = probs.view(shape.batch, shape.num_query_heads, -1)
    split = fp_keys.shape[1]
    return probs[..., :split], probs[..., split:].reshape(shape.batch, shape.num_query_heads, -1, w)
