"""The hand-off between transformers' attention modules and a compressed cache.

The model code stays untouched: its attention module calls ``cache.update`` and then the
registered attention function. Our cache leaves a note ("attend over layer i") in ``update``;
the attention function picks it up and lets the cache attend over that layer's store.
Calls without a note (a DynamicCache, a vision tower, training without cache) fall through to
transformers' SDPA path unchanged, so switching a model to ``vlm_kv`` attention never changes
what it computes with other caches.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from vlm_kv.attention.reference import soft_retention_attention

ATTN_IMPLEMENTATION = "vlm_kv"

_pending = threading.local()


class AttentionBypassError(RuntimeError):
    """A compressed cache's entries would be bypassed: the model computed something else."""


class Attends(Protocol):
    """What a compressed cache offers the attention function: attention of the new queries over
    what layer ``layer_idx`` holds, [B, Q, Hq, D]."""

    def attend(self, layer_idx: int, query: torch.Tensor, scaling: float | None) -> torch.Tensor: ...


@dataclass(frozen=True)
class Note:
    """A cache's note to the next attention call: attend over layer ``layer_idx`` of ``cache``."""

    cache: Attends
    layer_idx: int

    def attend(self, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        return self.cache.attend(self.layer_idx, query, scaling)


def hand_over(cache: Attends, layer_idx: int) -> None:
    """Called by a compressed cache's ``update``: the next attention call of this thread is ours.

    A hand-off still pending means the previous layer's attention never reached the ``vlm_kv``
    function (the attention implementation was switched after ``make_cache``): its output was
    computed from the new tokens alone, so we stop rather than return something else.
    """
    previous = getattr(_pending, "note", None)
    if previous is not None:
        _pending.note = None
        raise AttentionBypassError(unconsumed_message(previous.layer_idx))
    _pending.note = Note(cache, layer_idx)


def unconsumed_message(layer_idx: int) -> str:
    return (
        f"layer {layer_idx} stored its keys/values in the compressed cache but its attention did not run "
        f"through the {ATTN_IMPLEMENTATION!r} attention function, so the model attended over the new tokens "
        "only; was the attention implementation switched after make_cache (e.g. "
        "model.set_attn_implementation('sdpa'))? Call vlm_kv.make_cache (or vlm_kv.attach) again on this model"
    )


def begin_forward() -> None:
    """A forward with a compressed cache starts: every vlm_kv attention call must be handed a layer."""
    _pending.note = None
    _pending.active = True


def end_forward() -> None:
    """The forward ended; a hand-off still pending was never consumed."""
    _pending.active = False
    note = getattr(_pending, "note", None)
    _pending.note = None
    if note is not None:
        raise AttentionBypassError(unconsumed_message(note.layer_idx))


def end_forward_quietly() -> None:
    """The forward raised: forget its state without judging it."""
    _pending.active = False
    _pending.note = None


def _take_pending(module: torch.nn.Module) -> Note | None:
    note = getattr(_pending, "note", None)
    if note is None:
        if getattr(_pending, "active", False) and getattr(_pending, "log_beta", None) is None:
            raise AttentionBypassError(
                f"vlm_kv attention ran for layer {getattr(module, 'layer_idx', '?')} without cache.update: "
                "the compressed cache would be bypassed; the model must store its keys/values in the cache "
                "right before attention"
            )
        return None
    _pending.note = None
    idx = getattr(module, "layer_idx", None)
    if idx is not None and idx != note.layer_idx:
        raise AttentionBypassError(
            f"vlm_kv attention got layer {idx} but the cache prepared layer {note.layer_idx}; "
            "the model must call cache.update right before attention"
        )
    return note


def stash_log_beta(log_beta: torch.Tensor | None) -> None:
    """Soft retention for training: the next attention call of this thread adds
    ``(t - i) * log_beta[i]`` to its logits. log_beta: [B, H_kv, T_k]."""
    _pending.log_beta = log_beta


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
    note = _take_pending(module)
    log_beta = getattr(_pending, "log_beta", None)
    if note is None and log_beta is not None:
        _pending.log_beta = None
        return soft_retention_attention(query, key, value, log_beta, attention_mask, scaling), None
    if note is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return note.attend(query, scaling), None


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

