"""Decode: one new query per sequence over a store, read where its entries lie (PyTorch)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from vlm_kv.attention.reference import attention_received, varlen_attention
from vlm_kv.storage.store import own_head_bias


#: decode over at most this many entries per head (uniform stores) runs as one SDPA call on a copy.
#: Measured per call (one thread, 3 KV heads, 9 query heads, D 64): 69 vs 212 us at 59 entries,
#: 155 vs 207 us at 508, level at 827 (noise +-20 %); ragged stores: ~105 vs ~140 us at 177 entries,
#: ~110 vs ~170 us at 474 (scripts/decode_microbench.py).
SMALL_DECODE_ENTRIES = 512


def decode_attention(
    query: torch.Tensor, store: Any, scaling: float | None, want_received: bool = False
) -> tuple[torch.Tensor, tuple[torch.Tensor | None, torch.Tensor] | None]:
    """One new query per sequence over a store, read where the entries lie (no padded copy, except
    for a uniform store of at most ``SMALL_DECODE_ENTRIES`` entries per head: one SDPA call).

    query: [B, Hq, 1, D]. Returns the output [B, 1, Hq, D] and, with ``want_received``, the
    attention each entry received averaged over its query-head group, split as the store lays
    entries out: (body [N], tail [B, H, T]).

    Body and tail share one softmax. A body whose heads all hold the same length is a dense
    [B, H, L, D] view; a ragged body (adaptive or global allocations) is read per sequence as
    one flat block, each query head masked to its own KV head's run.
    """
    b, hq, _, d = query.shape
    h = store.num_kv_heads
    g = hq // h
    if query.dtype != torch.float32:
        return _decode_attention_low_precision(query, store, scaling, want_received)
    scale = scaling if scaling is not None else d ** -0.5
    if store.uniform and not want_received and store.tail_all_valid and store.max_length + store.tail_size <= SMALL_DECODE_ENTRIES:
        # Few entries: one SDPA call over body and tail laid side by side costs less than the
        # dozen small ops of the split softmax below; the copy is of at most
        # SMALL_DECODE_ENTRIES entries per head.
        keys, values = store.tail_keys, store.tail_values
        if store.body_size:
            body_k, body_v = store.body_dense()
            keys, values = torch.cat([body_k, keys], dim=2), torch.cat([body_v, values], dim=2)
        out = F.scaled_dot_product_attention(query, keys, values, scale=scale, enable_gqa=g > 1)
        return out.transpose(1, 2), None
    if (not store.uniform and not want_received and store.tail_all_valid
            and store.body_size + h * store.tail_size <= SMALL_DECODE_ENTRIES):
        return _decode_ragged_small(query, store, scale), None
    q = query.reshape(b, h, g, d)
    tail_k, tail_v = store.tail_keys, store.tail_values
    tail_logits = torch.matmul(q, tail_k.transpose(-1, -2)).float() * scale  # [B, H, g, T]
    if not store.tail_all_valid:
        tail_logits = tail_logits.masked_fill(~store.tail_valid[:, None, None, :], float("-inf"))
    T = tail_logits.shape[-1]
    if store.body_size == 0 or store.uniform:
        if store.body_size:
            body_k, body_v = store.body_dense()
            logits = torch.cat([torch.matmul(q, body_k.transpose(-1, -2)).float() * scale, tail_logits], dim=-1)
        else:
            body_v, logits = None, tail_logits
        probs = torch.softmax(logits, dim=-1)
        L = logits.shape[-1] - T
        p_tail = probs[..., L:].to(query.dtype)
        out = torch.matmul(p_tail, tail_v)
        if L:
            out = out + torch.matmul(probs[..., :L].to(query.dtype), body_v)
        out = out.reshape(b, hq, 1, d).transpose(1, 2)
        if not want_received:
            return out, None
        received_body = probs[..., :L].mean(dim=2).reshape(-1) if L else None
        return out, (received_body, probs[..., L:].mean(dim=2))
    outs, body_parts, tail_parts = [], [], []
    for i in range(b):
        start, count = store.batch_span(i)
        keys = store.body_keys[start : start + count]
        values = store.body_values[start : start + count]
        qi = q[i].reshape(h * g, d)
        # [H*g, n]: scaled logits, -inf where an entry belongs to another KV head than the query's
        body_logits = torch.addmm(store.head_bias(i, g), qi, keys.transpose(0, 1), alpha=scale)
        # the tail is dense per head: its logits sit on the block diagonal of the query heads
        logits = torch.cat([body_logits, tail_logits[i].reshape(h * g, T)], dim=-1)
        probs = torch.softmax(logits, dim=-1)
        p_body = probs[:, :count].to(query.dtype)
        p_tail = probs[:, count:].reshape(h, g, T).to(query.dtype)
        out = torch.matmul(p_body, values) + torch.matmul(p_tail, tail_v[i]).reshape(h * g, d)
        outs.append(out)
        if want_received:
            body_parts.append(probs[:, :count].reshape(h, g, count).mean(dim=1).sum(dim=0))
            tail_parts.append(probs[:, count:].reshape(h, g, T).mean(dim=1))
    out = torch.stack(outs).view(b, 1, hq, d)
    if not want_received:
        return out, None
    return out, (torch.cat(body_parts), torch.stack(tail_parts))


def _tail_head_bias(h: int, g: int, t: int, device: torch.device) -> torch.Tensor:
    """[H * g, H * t] float32: 0 where a query head meets a tail entry of its own KV head (the tail
    flattened head-major), -inf elsewhere."""
    key = (h, g, t, device)
    if key not in _TAIL_BIAS:
        if len(_TAIL_BIAS) > 256:
            _TAIL_BIAS.clear()
        _TAIL_BIAS[key] = own_head_bias(torch.arange(h * t, device=device) // t, h, g)
    return _TAIL_BIAS[key]


_TAIL_BIAS: dict[tuple, torch.Tensor] = {}


def _decode_ragged_small(query: torch.Tensor, store: Any, scale: float) -> torch.Tensor:
    """Decode over a small ragged store (fp32): per sequence, the flat body and the head-major tail
    form one key list that every query head attends through an additive mask of its own KV head's
    entries (one masked softmax instead of the split softmax's dozen small ops). [B, 1, Hq, D]."""
    b, hq, _, d = query.shape
    h, t = store.num_kv_heads, store.tail_size
    g = hq // h
    tail_bias = _tail_head_bias(h, g, t, query.device)
    outs = []
    for i in range(b):
        start, count = store.batch_span(i)
        keys = torch.cat([store.body_keys[start : start + count], store.tail_keys[i].reshape(h * t, d)])
        values = torch.cat([store.body_values[start : start + count], store.tail_values[i].reshape(h * t, d)])
        bias = torch.cat([store.head_bias(i, g), tail_bias], dim=1)
        # addmm + softmax + mm rather than SDPA with a float mask: at these sizes SDPA's set-up is
        # most of its cost (the whole call: 47 vs 63 us at 177 entries, 70 vs 74 at 320, one thread)
        logits = torch.addmm(bias, query[i].reshape(hq, d), keys.transpose(0, 1), alpha=scale)
        outs.append(torch.matmul(torch.softmax(logits, dim=-1), values))
    return (outs[0] if b == 1 else torch.stack(outs)).view(b, 1, hq, d)

def _decode_attention_low_precision(query: torch.Tensor, store: Any, scaling: float | None, want_received: bool):
    """bf16 / fp16: CPU matmuls round their logits to the input dtype, which moves greedy tokens
    away from what SDPA (fp32 accumulation and softmax) computes for a DynamicCache; so these
    dtypes attend with SDPA over the body and tail laid side by side."""
    view = store.padded_view(with_values=True, with_modality=False)
    positions = store.tail_positions[-1:].long()
    out = varlen_attention(query, view, positions, scaling, store.body_size == 0 and store.tail_all_valid)
    if not want_received:
        return out, None
    return out, store.split_padded(attention_received(query, view, positions, scaling))


@dataclass(frozen=True)
class RotatedEntries:
    """One sequence's INT2 entries for decode in PyTorch, flat, grouped by KV head and left in the
    basis they were quantized in.

    ``keys`` [m, D] float32: ``k @ key_basis`` dequantized. Values stay as codes: ``value_codes``
    [m, D] float32 (0..3) with ``value_scale`` / ``value_zero`` [m] float32, the value of entry j
    being ``value_codes[j] * value_scale[j] + value_zero[j]`` (of ``v @ value_basis``): a per-entry
    grid folds into the attention weights ([Hq, m]) for less work than expanding every value
    ([m, D]). ``head_counts``: entries of each KV head, in order (they sum to m). ``holes`` [m]
    bool marks slots that are not attended (a hole, an empty slot), or None when there are none."""

    keys: torch.Tensor
    value_codes: torch.Tensor
    value_scale: torch.Tensor
    value_zero: torch.Tensor
    head_counts: tuple[int, ...]
    holes: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.keys.shape[0]

    def logits(self, rotated_query: torch.Tensor, group: int, scale: float) -> torch.Tensor:
        # the product runs over every head at once (one matrix product; the keys are read once
        # either way) and the other heads' entries are masked after, by slices
        m = len(self)
        logits = torch.mm(rotated_query, self.keys.transpose(0, 1)).mul_(scale)
        per_head = logits.view(len(self.head_counts), group, m)
        start = 0
        for h, count in enumerate(self.head_counts):
            if start:
                per_head[h, :, :start] = float("-inf")
            if start + count < m:
                per_head[h, :, start + count :] = float("-inf")
            start += count
        if self.holes is not None:
            logits.masked_fill_(self.holes[None, :], float("-inf"))
        return logits

    def weighted_values(self, probs: torch.Tensor) -> torch.Tensor:
        return torch.addmm(torch.mv(probs, self.value_zero)[:, None], probs * self.value_scale, self.value_codes)


def decode_attention_with_rotated(query: torch.Tensor, store: Any, int2: Sequence[RotatedEntries],
                                  key_basis: torch.Tensor | None, value_basis: torch.Tensor | None,
                                  scaling: float | None) -> torch.Tensor:
    """One new query per sequence over a store's FP entries and INT2 entries (``int2[b]`` for
    sequence ``b``) in one float32 softmax; [B, 1, Hq, D]. The pure PyTorch path; the C++ kernel
    (``vlm_kv.attention.backend.tiered_decode_attention_cpu``) is checked against it.

    As ``reference.rotated_tier_attention`` (which it is checked against) but read where the
    entries lie: the FP body flat per sequence with each query head masked to its KV head's run,
    the tail dense per head, the INT2 entries flat; no padded per-row copy of either tier is built
    (laying both out per row cost more than the attention itself at every decode step)."""
    b, hq, _, d = query.shape
    h = store.num_kv_heads
    g = hq // h
    t = store.tail_size
    scale = scaling if scaling is not None else d ** -0.5
    q = query.reshape(b, hq, d).float()
    rotated = q if key_basis is None else q @ key_basis
    tail_k, tail_v = store.tail_keys.float(), store.tail_values.float()
    tail_logits = torch.matmul(q.view(b, h, g, d), tail_k.transpose(-1, -2)) * scale  # [B, H, g, T]
    if not store.tail_all_valid:
        tail_logits = tail_logits.masked_fill(~store.tail_valid[:, None, None, :], float("-inf"))
    outs = []
    for i in range(b):
        start, count = store.batch_span(i)
        parts = [tail_logits[i].reshape(hq, t)]
        if count:
            body_k = store.body_keys[start : start + count].float()
            parts.insert(0, torch.addmm(store.head_bias(i, g), q[i], body_k.transpose(0, 1), alpha=scale))
        entries = int2[i]
        m = len(entries)
        if m:
            if len(entries.head_counts) != h or sum(entries.head_counts) != m:
                raise ValueError(f"INT2 entries of sequence {i}: head counts {entries.head_counts} do not "
                                 f"split {m} entries over {h} KV heads")
            parts.append(entries.logits(rotated[i], g, scale))
        probs = torch.softmax(torch.cat(parts, dim=-1), dim=-1)
        out = torch.matmul(probs[:, count : count + t].reshape(h, g, t), tail_v[i]).reshape(hq, d)
        if count:
            out = out + probs[:, :count] @ store.body_values[start : start + count].float()
        if m:
            out_q = entries.weighted_values(probs[:, count + t :])
            out = out + (out_q if value_basis is None else out_q @ value_basis.T)
        outs.append(out)
    return torch.stack(outs).view(b, 1, hq, d).to(query.dtype)
