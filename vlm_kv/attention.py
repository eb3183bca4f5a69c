"""Attention over a compressed store, plugged into transformers' AttentionInterface.

The model code stays untouched: its attention module calls ``cache.update`` and then the
registered attention function. Our cache layers leave a note ("attend over me") in
``update``; the attention function picks it up and attends over the layer's store, with
per-head lengths and GQA. Calls without a note (a DynamicCache, a vision tower, training
without cache) fall through to transformers' SDPA path unchanged, so switching a model to
``vlm_kv`` attention never changes what it computes with other caches.

``varlen_attention`` is the pure PyTorch path; ``vlm_kv.kernels`` may provide a faster one
with the same signature.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from vlm_kv.storage import PaddedView

ATTN_IMPLEMENTATION = "vlm_kv"

_pending = threading.local()


def hand_over(layer: Any) -> None:
    """Called by a cache layer's ``update``: the next attention call of this thread is ours."""
    _pending.layer = layer


def _take_pending(module: torch.nn.Module) -> Any:
    layer = getattr(_pending, "layer", None)
    if layer is None:
        return None
    _pending.layer = None
    idx = getattr(module, "layer_idx", None)
    if idx is not None and idx != layer.layer_idx:
        raise RuntimeError(
            f"vlm_kv attention got layer {idx} but the cache prepared layer {layer.layer_idx}; "
            "the model must call cache.update right before attention"
        )
    return layer


def attention_mask(view: PaddedView, query_positions: torch.Tensor) -> torch.Tensor:
    """[B, H, Q, L] bool: an entry is visible to a query if it is valid and not in its future."""
    mask = view.valid[:, :, None, :] & (view.positions[:, :, None, :] <= query_positions.view(1, 1, -1, 1))
    # Rows with nothing visible (padding queries) would give NaN; let them see everything: their
    # outputs are never read, and finite garbage cannot leak into real tokens.
    empty = ~mask.any(dim=-1, keepdim=True)
    return mask | empty


def _pack_gqa(query: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[B, Hq, Q, D] -> [B, H, g*Q, D]: the query heads of a group share their KV head's entries."""
    b, hq, q, d = query.shape
    return query.reshape(b, num_kv_heads, (hq // num_kv_heads) * q, d)


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
    mask = attention_mask(view, query_positions)  # [B, H, Q, L]
    g = hq // h
    packed = _pack_gqa(query, h)
    mask = mask[:, :, None].expand(b, h, g, q, view.length).reshape(b, h, g * q, view.length)
    out = F.scaled_dot_product_attention(packed, view.keys, view.values, attn_mask=mask, scale=scaling)
    return out.view(b, hq, q, d).transpose(1, 2)


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
    logits = logits.masked_fill(~mask, float("-inf"))
    return torch.softmax(logits, dim=-1)


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

