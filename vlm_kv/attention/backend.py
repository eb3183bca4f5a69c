"""The compiled paths: the only caller of ``vlm_kv.kernels`` (Triton decode, varlen prefill).
Each imports its kernel module when first used, so the runtime loads without Triton."""

from __future__ import annotations

from typing import Any

import torch

from vlm_kv.kernels.varlen_prefill import paged_prefill_attention


def _no_entries(like: torch.Tensor, rows: int) -> tuple[torch.Tensor, ...]:
    """A paged source holding nothing (one-entry blocks of ``like``'s dtype), for the decode kernel."""
    none = like.new_zeros(0, 1, like.shape[-1])
    zeros = torch.zeros(rows, dtype=torch.int32, device=like.device)
    return none, none, zeros[:, None], zeros


def decode_attention_triton(query: torch.Tensor, store: Any, scaling: float | None) -> torch.Tensor:
    """``decode_attention`` through the Triton paged decode kernel: the body is read in place as a
    paged store with one-entry blocks, the tail buffer likewise; one softmax over both. [B, 1, Hq, D]."""
    # lazy: vlm_kv.kernels.paged_triton imports triton, which is optional
    from vlm_kv.kernels.paged_triton import paged_decode_sources_triton

    b, hq, _, d = query.shape
    sources = [store.paged_body()] if store.body_size else []
    sources.append(store.paged_tail())
    out = paged_decode_sources_triton(query[:, :, 0].contiguous(), sources, scaling)
    return out.view(b, 1, hq, d)


def tiered_decode_attention_triton(query: torch.Tensor, store: Any, tier: Any, scaling: float | None) -> torch.Tensor:
    """Decode over a store and its INT2 tier through the Triton kernel: body (one-entry blocks) with
    the packed INT2 windows, then the tail, in one softmax; the kernel reads the 2-bit codes
    directly. [B, 1, Hq, D]."""
    # lazy: vlm_kv.kernels.paged_triton imports triton, which is optional
    from vlm_kv.kernels.paged_triton import paged_decode_sources_triton

    b, hq, _, d = query.shape
    rows = store.batch_size * store.num_kv_heads
    body = store.paged_body() if store.body_size else _no_entries(store.body_keys, rows)
    tail = store.paged_tail()
    int2 = tier.kernel_pools()
    q = query[:, :, 0].contiguous()
    if not tier.rotated:
        out = paged_decode_sources_triton(q, [body + (int2,), tail], scaling)
    else:  # rotated INT2 windows: their own source, read with the rotated query
        bases = [None, (tier.key_basis, tier.value_basis), None]
        int2_only = _no_entries(store.body_keys, rows) + (int2,)
        out = paged_decode_sources_triton(q, [body, int2_only, tail], scaling, bases=bases)
    return out.view(b, 1, hq, d)


def prefill_attention_paged(query: torch.Tensor, store: Any, scaling: float | None, backend: str = "auto") -> torch.Tensor:
    """Several new queries (a new turn, a prefill chunk) over a compressed store through the varlen
    prefill path of ``vlm_kv.kernels`` (flash-attn's varlen function on CUDA): each (batch, kv head)
    row is one sequence of its kept entries followed by the tail, the new tokens last, causal from
    the bottom right. Needs a tail without padding. Returns [B, Q, Hq, D]."""

    d = query.shape[-1]
    rows, T = store.batch_size * store.num_kv_heads, store.tail_size
    # one transient pool: body, then each row's tail (a working copy, as for the padded view)
    keys = torch.cat([store.body_keys, store.tail_keys.reshape(rows * T, d)])
    values = torch.cat([store.body_values, store.tail_values.reshape(rows * T, d)])
    cols = torch.arange(store.max_length + T, device=query.device)[None, :]
    body_part = store.row_starts[:, None] + cols
    tail_part = store.body_size + torch.arange(rows, device=query.device)[:, None] * T + (cols - store.lengths[:, None])
    table = torch.where(cols < store.lengths[:, None], body_part, tail_part)
    table = table.clamp(0, max(keys.shape[0] - 1, 0)).to(torch.int32)
    lengths = (store.lengths + T).to(torch.int32)
    out = paged_prefill_attention(query, keys.view(-1, 1, d), values.view(-1, 1, d), table, lengths, scaling,
                                  causal=True, backend=backend, validate=False)
    return out.transpose(1, 2)

