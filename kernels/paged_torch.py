"""Pure PyTorch decode attention over paged FP sources and INT2 windows (the reference).

One decode query per (batch, query head) attends over its kv head's row. Each source's rows are
gathered into one [rows, L, D] tensor (L = the longest row rounded up to whole blocks, or to whole
windows), the sources are laid side by side in the order given, and all rows are attended in one
masked SDPA call; no Python loop over rows. INT2 windows are dequantized (float32; windows
quantized in a rotated basis are rotated back to the channel basis): softmax does not depend on
order, so one softmax covers every source. Entries stay in the pools' dtype when every source
shares it and are attended in float32 otherwise (always when INT2 windows are read). SDPA
accumulates the softmax in float32; the output is cast to the query dtype. A row with no entries
gives zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from collections.abc import Sequence
from dataclasses import replace

from vlm_kv.kernels.int2 import dequantize_keys, dequantize_values
from vlm_kv.kernels.layout import PagedShape, check_int2_store, check_launches, check_paged_store
from vlm_kv.kernels.sources import Int2Source, PagedSource, Source, launch_plan


def gather_paged_rows(fp: PagedSource) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every row's entries, left aligned: (keys, values [rows, L, D], valid [rows, L]) with L the
    longest row rounded up to whole blocks; ``valid`` is False at slots past a row's length."""
    key_pool, value_pool, block_table, lengths = fp.key_pool, fp.value_pool, fp.block_table, fp.lengths
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


def gather_int2_rows(int2: Int2Source) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every row's INT2 windows dequantized (float32, in the basis they were quantized in):
    (keys, values [rows, L, D], valid [rows, L]); ``int2.slot_mask`` marks the attended slots."""
    key_codes, key_scale, key_zero, value_codes, value_scale, value_zero = int2.pools()
    int2_table, int2_counts, slot_mask = int2.table, int2.counts, int2.slot_mask
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


def _int2_rows_in_channel_basis(int2: Int2Source) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``gather_int2_rows``, with windows quantized in a rotated basis rotated back (``x = x' @ R.T``)."""
    keys, values, valid = gather_int2_rows(int2)
    if int2.key_basis is not None:
        keys = keys @ int2.key_basis.T
    if int2.value_basis is not None:
        values = values @ int2.value_basis.T
    return keys, values, valid


def _gather_sources(query: torch.Tensor, sources: Sequence[Source], validate: bool
                    ) -> tuple[PagedShape, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check a step's sources and lay every row's entries side by side in source order: (shape, keys,
    values [rows, L, D], valid [rows, L]) in the sources' common dtype, float32 when they differ."""
    groups = launch_plan(query, sources)
    shapes = check_launches(query, groups, validate)
    parts = []
    for group in groups:
        parts.append(gather_paged_rows(group.fp))
        if group.int2 is not None:
            parts.append(_int2_rows_in_channel_basis(group.int2))
    if len(parts) == 1:
        return (shapes[0],) + parts[0]
    widen = len({keys.dtype for keys, _, _ in parts}) > 1
    keys = torch.cat([k.float() if widen else k for k, _, _ in parts], dim=1)
    values = torch.cat([v.float() if widen else v for _, v, _ in parts], dim=1)
    valid = torch.cat([ok for _, _, ok in parts], dim=1)
    return shapes[0], keys, values, valid


def paged_decode_attention_torch(
    query: torch.Tensor, sources: Sequence[Source], scaling: float | None = None, validate: bool = True
) -> torch.Tensor:
    """Decode attention of ``query`` [B, Hq, D] over ``sources`` (paged FP entries and INT2 windows of
    the same rows) in one softmax; returns [B, Hq, D] in the query dtype. ``scaling`` None:
    ``head_dim ** -0.5``; ``validate`` also reads the tables (see ``layout.check_paged_store``)."""
    shape, keys, values, valid = _gather_sources(query, sources, validate)
    return _attend_rows(query, shape, keys, values, valid, scaling)


def mixed_attention_weights_torch(
    query: torch.Tensor, fp: PagedSource, int2: Int2Source, scaling: float | None = None, validate: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax weights of the decode over ``[fp, int2]`` for scorers (fused kernels never produce them).

    Returns float32 ``(fp_weights [B, Hq, L], int2_weights [B, Hq, max_windows_held, w])``:
    ``fp_weights[b, qh, i]`` is the weight of FP entry i of the query head's row (L = longest
    row rounded up to whole blocks, zeros past a row's length) and ``int2_weights[b, qh, j, t]``
    that of token t of the row's j-th INT2 window (``int2.table[r, j]``). Both tiers share one
    softmax, so a row's weights sum to 1 (0 for a row with no entries).
    """
    shape = check_paged_store(query, fp, validate)
    w = check_int2_store(shape, query.device, int2, validate)
    fp_keys, _, fp_valid = gather_paged_rows(replace(fp, value_pool=fp.key_pool))  # values not needed
    q_keys, _, q_valid = _int2_rows_in_channel_basis(int2)
    keys = torch.cat([fp_keys.float(), q_keys], dim=1)
    valid = torch.cat([fp_valid, q_valid], dim=1)
    scale = scaling if scaling is not None else shape.head_dim ** -0.5
    q = query.reshape(shape.rows, shape.group, shape.head_dim).float() * scale
    logits = torch.bmm(q, keys.transpose(1, 2)).masked_fill_(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)
    probs = probs.view(shape.batch, shape.num_query_heads, -1)
    split = fp_keys.shape[1]
    return probs[..., :split], probs[..., split:].reshape(shape.batch, shape.num_query_heads, -1, w)
