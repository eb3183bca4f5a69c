"""Pure PyTorch attention over padded views of a compressed store: the reference every other
path is checked against, plus the explicit probabilities scorers read and the soft-retention
attention gate training uses."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vlm_kv.storage.store import PaddedView

MASKED_BLOCK_BYTES = 4 * 2**20  # the most float mask one masked SDPA call of ``varlen_attention`` builds


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
    # SDPA turns a boolean mask into one of the query's dtype: [B, Hq, Q, L] floats, 75 MB for a
    # 1024-token prefill chunk over 2048 entries in float32 (more than DynamicCache's whole prefill
    # peak adds). So the queries go in blocks whose mask stays within MASKED_BLOCK_BYTES; each
    # query's row is computed alone either way (tested: the same output).
    block = max(1, MASKED_BLOCK_BYTES // max(1, b * hq * view.length * 4))
    outs = []
    for start in range(0, q, block):
        rows = slice(start, min(q, start + block))
        mask = _gqa_mask(attention_mask(view, query_positions[rows]), hq // h)
        packed = _pack_gqa(query[:, :, rows], h)
        out = F.scaled_dot_product_attention(packed, view.keys, view.values, attn_mask=mask, scale=scaling)
        outs.append(out.view(b, hq, rows.stop - rows.start, d))
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)).transpose(1, 2)


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


#: float32 bytes of attention probabilities one chunk of ``attention_received`` may hold (the
#: logits and the probabilities are alive together, so twice this at the peak). Why bounded in
#: bytes: at 256 queries a chunk of SmolLM2's 9 heads held 19 MB at 2048 keys and 75 MB at 8192,
#: which put qevict's prefill above DynamicCache's process peak (docs/tiered_prefill.md).
RECEIVED_CHUNK_BYTES = 4 * 2**20


def attention_received(
    query: torch.Tensor,
    view: PaddedView,
    query_positions: torch.Tensor,
    scaling: float | None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Attention each entry receives, summed over queries and averaged over a group: [B, H, L].

    Chunked over queries so memory stays bounded whatever the prefill length: ``chunk`` queries at
    a time, by default as many as keep one chunk's probabilities within ``RECEIVED_CHUNK_BYTES``
    (at most 256, at least 1).
    """
    if chunk is None:
        row_bytes = 4 * query.shape[0] * query.shape[1] * max(view.length, 1)
        chunk = max(1, min(256, RECEIVED_CHUNK_BYTES // row_bytes))
    total = None
    for start in range(0, query.shape[2], chunk):
        probs = attention_probs(query[:, :, start : start + chunk], view, query_positions[start : start + chunk], scaling)
        part = probs.sum(dim=3).mean(dim=2)
        total = part if total is None else total + part
    return total

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

