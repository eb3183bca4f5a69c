"""Attention over a compressed store, plugged into transformers' AttentionInterface.

The model code stays untouched: its attention module calls ``cache.update`` and then the
registered attention function. Our cache layers leave a note ("attend over me") in
``update``; the attention function picks it up and attends over the layer's store, with
per-head lengths and GQA. Calls without a note (a DynamicCache, a vision tower, training
without cache) fall through to transformers' SDPA path unchanged, so switching a model to
``vlm_kv`` attention never changes what it computes with other caches.

``varlen_attention`` is the pure PyTorch path for several queries (prefill, a new turn) over a
padded working copy; ``decode_attention`` serves one query per sequence straight from the store.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from vlm_kv.storage import PaddedView, own_head_bias

ATTN_IMPLEMENTATION = "vlm_kv"

_pending = threading.local()


class AttentionBypassError(RuntimeError):
    """A compressed cache's entries would be bypassed: the model computed something else."""


def hand_over(layer: Any) -> None:
    """Called by a cache layer's ``update``: the next attention call of this thread is ours.

    A hand-off still pending means the previous layer's attention never reached the ``vlm_kv``
    function (the attention implementation was switched after ``make_cache``): its output was
    computed from the new tokens alone, so we stop rather than return something else.
    """
    previous = getattr(_pending, "layer", None)
    if previous is not None:
        _pending.layer = None
        raise AttentionBypassError(unconsumed_message(previous.layer_idx))
    _pending.layer = layer


def unconsumed_message(layer_idx: int) -> str:
    return (
        f"layer {layer_idx} stored its keys/values in the compressed cache but its attention did not run "
        f"through the {ATTN_IMPLEMENTATION!r} attention function, so the model attended over the new tokens "
        "only; was the attention implementation switched after make_cache (e.g. "
        "model.set_attn_implementation('sdpa'))? Call vlm_kv.make_cache (or vlm_kv.attach) again on this model"
    )


def begin_forward() -> None:
    """A forward with a compressed cache starts: every vlm_kv attention call must be handed a layer."""
    _pending.layer = None
    _pending.active = True


def end_forward() -> None:
    """The forward ended; a hand-off still pending was never consumed."""
    _pending.active = False
    layer = getattr(_pending, "layer", None)
    _pending.layer = None
    if layer is not None:
        raise AttentionBypassError(unconsumed_message(layer.layer_idx))


def end_forward_quietly() -> None:
    """The forward raised: forget its state without judging it."""
    _pending.active = False
    _pending.layer = None


def _take_pending(module: torch.nn.Module) -> Any:
    layer = getattr(_pending, "layer", None)
    if layer is None:
        if getattr(_pending, "active", False) and getattr(_pending, "log_beta", None) is None:
            raise AttentionBypassError(
                f"vlm_kv attention ran for layer {getattr(module, 'layer_idx', '?')} without cache.update: "
                "the compressed cache would be bypassed; the model must store its keys/values in the cache "
                "right before attention"
            )
        return None
    _pending.layer = None
    idx = getattr(module, "layer_idx", None)
    if idx is not None and idx != layer.layer_idx:
        raise AttentionBypassError(
            f"vlm_kv attention got layer {idx} but the cache prepared layer {layer.layer_idx}; "
            "the model must call cache.update right before attention"
        )
    return layer


def _visible(view: PaddedView, query_positions: torch.Tensor) -> torch.Tensor:
    """[B, H, Q, L] bool: valid entries not in the query's future (rows may be all False)."""
    return view.valid[:, :, None, :] & (view.positions[:, :, None, :] <= query_positions.view(1, 1, -1, 1))


def attention_mask(view: PaddedView, query_positions: torch.Tensor) -> torch.Tensor:
    """[B, H, Q, L] bool: an entry is visible to a query if it is valid and not in its future."""
    mask = _visible(view, query_positions)
    # Rows with nothing visible (padding queries) would give NaN; let them see everything: their
    # outputs are never read, and finite garbage cannot leak into real tokens.
    empty = ~mask.any(dim=-1, keepdim=True)
    return mask | empty


def _pack_gqa(query: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[B, Hq, Q, D] -> [B, H, g*Q, D]: the query heads of a group share their KV head's entries."""
    b, hq, q, d = query.shape
    return query.reshape(b, num_kv_heads, (hq // num_kv_heads) * q, d)


def _gqa_mask(mask: torch.Tensor, group: int) -> torch.Tensor:
    """[B, H, Q, L] -> [B, H, g*Q, L], the layout of ``_pack_gqa``'s queries."""
    b, h, q, length = mask.shape
    return mask[:, :, None].expand(b, h, group, q, length).reshape(b, h, group * q, length)


def varlen_attention(
    query: torch.Tensor,
    view: PaddedView,
    query_positions: torch.Tensor,
    scaling: float | None,
    dense_causal: bool = False,
) -> torch.Tensor:
    """Softmax attention of ``query`` [B, Hq, Q, D] over the view; returns [B, Q, Hq, D].

    ``dense_causal``: the view is exactly the last tokens with nothing evicted or padded, so a
    plain causal SDPA call is equivalent (and is what DynamicCache would run).
    """
    b, hq, q, d = query.shape
    h = view.keys.shape[1]
    if dense_causal:
        causal = q > 1 and q == view.length
        if causal or q == 1:
            out = F.scaled_dot_product_attention(
                query, view.keys, view.values, is_causal=causal, scale=scaling, enable_gqa=hq != h
            )
            return out.transpose(1, 2)
    mask = _gqa_mask(attention_mask(view, query_positions), hq // h)
    packed = _pack_gqa(query, h)
    out = F.scaled_dot_product_attention(packed, view.keys, view.values, attn_mask=mask, scale=scaling)
    return out.view(b, hq, q, d).transpose(1, 2)


def rotated_tier_attention(
    query: torch.Tensor,
    fp: PaddedView,
    tier: PaddedView,
    key_basis: torch.Tensor | None,
    value_basis: torch.Tensor | None,
    query_positions: torch.Tensor,
    scaling: float | None,
) -> torch.Tensor:
    """One softmax of ``query`` [B, Hq, Q, D] over FP entries (``fp``) and INT2 entries left in the
    basis they were quantized in (``tier``: keys ``k @ key_basis``, values ``v @ value_basis``);
    returns [B, Q, Hq, D]. The INT2 logits use ``q @ key_basis`` and their weighted values are
    rotated back by ``value_basis.T`` once, instead of rotating every entry (as the Triton kernel
    does). Float32 throughout; meant for decode (the logits are materialized)."""
    b, hq, q, d = query.shape
    h = fp.keys.shape[1]
    scale = scaling if scaling is not None else d ** -0.5
    seen_fp = _gqa_mask(_visible(fp, query_positions), hq // h)
    seen_q = _gqa_mask(_visible(tier, query_positions), hq // h)
    # a query with nothing visible (padding) sees every FP slot, as in attention_mask
    seen_fp = seen_fp | ~(seen_fp.any(-1, keepdim=True) | seen_q.any(-1, keepdim=True))
    packed = _pack_gqa(query, h).float()
    rotated = packed if key_basis is None else packed @ key_basis
    logits = torch.cat([
        (packed @ fp.keys.float().transpose(-1, -2) * scale).masked_fill_(~seen_fp, float("-inf")),
        (rotated @ tier.keys.float().transpose(-1, -2) * scale).masked_fill_(~seen_q, float("-inf")),
    ], dim=-1)
    probs = torch.softmax(logits, dim=-1)
    split = fp.length
    out_q = probs[..., split:] @ tier.values.float()
    if value_basis is not None:
        out_q = out_q @ value_basis.T
    out = probs[..., :split] @ fp.values.float() + out_q
    return out.view(b, hq, q, d).transpose(1, 2).to(query.dtype)


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


def decode_attention_triton(query: torch.Tensor, store: Any, scaling: float | None) -> torch.Tensor:
    """``decode_attention`` through the Triton paged decode kernel: the body is read in place as a
    paged store with one-entry blocks, the tail buffer likewise; one softmax over both. [B, 1, Hq, D]."""
    from vlm_kv.kernels.paged_triton import paged_decode_sources_triton

    b, hq, _, d = query.shape
    rows = store.batch_size * store.num_kv_heads
    sources = []
    if store.body_size:
        table, lengths = store.body_table()
        sources.append((store.body_keys.view(-1, 1, d), store.body_values.view(-1, 1, d), table, lengths))
    cap, T = store.tail_capacity, store.tail_size
    tail_table = (torch.arange(rows, device=query.device) * cap)[:, None] + torch.arange(T, device=query.device)[None]
    sources.append((store._tail_k.view(-1, 1, d), store._tail_v.view(-1, 1, d), tail_table.to(torch.int32),
                    torch.full((rows,), T, dtype=torch.int32, device=query.device)))
    out = paged_decode_sources_triton(query[:, :, 0].contiguous(), sources, scaling)
    return out.view(b, 1, hq, d)


def prefill_attention_paged(query: torch.Tensor, store: Any, scaling: float | None, backend: str = "auto") -> torch.Tensor:
    """Several new queries (a new turn, a prefill chunk) over a compressed store through the varlen
    prefill path of ``vlm_kv.kernels`` (flash-attn's varlen function on CUDA): each (batch, kv head)
    row is one sequence of its kept entries followed by the tail, the new tokens last, causal from
    the bottom right. Needs a tail without padding. Returns [B, Q, Hq, D]."""
    from vlm_kv.kernels.varlen_prefill import paged_prefill_attention

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


def attention_probs(
    query: torch.Tensor,
    view: PaddedView,
    query_positions: torch.Tensor,
    scaling: float | None,
) -> torch.Tensor:
    """Explicit softmax(q k^T) for a few queries: [B, H, g, Q, L] in float32.

    Used by scorers, only for the queries they need (an observation window, the current token),
    so the model itself never has to run eager attention.
    """
    b, hq, q, d = query.shape
    h = view.keys.shape[1]
    g = hq // h
    scale = scaling if scaling is not None else d ** -0.5
    packed = _pack_gqa(query, h).float()
    logits = torch.matmul(packed, view.keys.float().transpose(-1, -2)) * scale  # [B, H, g*Q, L]
    logits = logits.view(b, h, g, q, view.length)
    mask = attention_mask(view, query_positions)[:, :, None]
    return torch.softmax(logits.masked_fill_(~mask, float("-inf")), dim=-1)


def attention_received(
    query: torch.Tensor,
    view: PaddedView,
    query_positions: torch.Tensor,
    scaling: float | None,
    chunk: int = 256,
) -> torch.Tensor:
    """Attention each entry receives, summed over queries and averaged over a group: [B, H, L].

    Chunked over queries so memory stays O(chunk * L) whatever the prefill length.
    """
    total = None
    for start in range(0, query.shape[2], chunk):
        probs = attention_probs(query[:, :, start : start + chunk], view, query_positions[start : start + chunk], scaling)
        part = probs.sum(dim=3).mean(dim=2)
        total = part if total is None else total + part
    return total


def stash_log_beta(log_beta: torch.Tensor | None) -> None:
    """Soft retention for training: the next attention call of this thread adds
    ``(t - i) * log_beta[i]`` to its logits. log_beta: [B, H_kv, T_k]."""
    _pending.log_beta = log_beta


def soft_retention_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_beta: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    chunk: int = 512,
) -> torch.Tensor:
    """Causal attention with retention decay: logit(t, i) += (t - i) * log beta_i.

    query [B, Hq, Tq, D], key/value [B, H, Tk, D], log_beta [B, H, Tk]; queries are the last Tq
    positions. Chunked over queries, each chunk recomputed in backward, so training memory
    grows linearly with the sequence. With log beta = 0 this is plain causal attention.
    Returns [B, Tq, Hq, D].
    """
    b, hq, tq, d = query.shape
    h, tk = key.shape[1], key.shape[2]
    g = hq // h
    scale = scaling if scaling is not None else d ** -0.5
    offset = tk - tq
    key_pos = torch.arange(tk, device=query.device)

    def block(q_chunk: torch.Tensor, start: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lb: torch.Tensor,
              mask: torch.Tensor | None) -> torch.Tensor:
        c = q_chunk.shape[2]
        q_pos = torch.arange(c, device=q_chunk.device) + int(start) + offset
        logits = torch.matmul(q_chunk.float().reshape(b, h, g * c, d), k.float().transpose(-1, -2)) * scale
        logits = logits.view(b, h, g, c, tk)
        age = (q_pos[:, None] - key_pos[None, :]).clamp(min=0).float()  # [c, Tk]
        logits = logits + age[None, None, None] * lb.float()[:, :, None, None, :]
        visible = key_pos[None, :] <= q_pos[:, None]
        if mask is not None:
            visible = visible[None, None] & mask[:, :, None]  # mask: [B, 1, c, Tk]
        else:
            visible = visible[None, None, None]
        logits = logits.masked_fill(~visible, torch.finfo(torch.float32).min)
        probs = torch.softmax(logits, dim=-1)
        out = torch.matmul(probs.view(b, h, g * c, tk), v.float())
        return out.view(b, hq, c, d).to(query.dtype)

    outs = []
    for start in range(0, tq, chunk):
        q_chunk = query[:, :, start : start + chunk]
        mask = None
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            mask = attention_mask[:, :1, start : start + chunk, -tk:]
        start_t = torch.tensor(start)
        if torch.is_grad_enabled() and (log_beta.requires_grad or query.requires_grad):
            outs.append(torch.utils.checkpoint.checkpoint(block, q_chunk, start_t, key, value, log_beta, mask,
                                                          use_reentrant=False))
        else:
            outs.append(block(q_chunk, start_t, key, value, log_beta, mask))
    return torch.cat(outs, dim=2).transpose(1, 2)


def vlm_kv_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    layer = _take_pending(module)
    log_beta = getattr(_pending, "log_beta", None)
    if layer is None and log_beta is not None:
        _pending.log_beta = None
        return soft_retention_attention(query, key, value, log_beta, attention_mask, scaling), None
    if layer is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return layer.attend(query, scaling), None


_registered = False


def register() -> str:
    """Register the ``vlm_kv`` attention and mask functions once; returns the implementation name."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTN_IMPLEMENTATION, vlm_kv_attention)
        # Same masks as SDPA, so the fallback path sees exactly what SDPA would.
        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
        _registered = True
    return ATTN_IMPLEMENTATION

