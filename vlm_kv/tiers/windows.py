"""Windows of the tiered cache: ids, score reductions, ranking groups, and gathering entries into windows.

A window is ``w`` consecutive positions of one (batch, kv head) row, counted from the sequence's
first real token: id ``(position - origin) // w`` with ``origin`` that token's position
(``TokenLedger.first_positions``). So a sequence's windows hold the same tokens whatever padding
its batch puts before them. The window router (``window_router``) and the entry router
(``entry_router``) share these.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlm_kv.storage.store import EntrySource, PaddedView

FP, INT2, EVICT = 0, 1, 2


def window_of(positions: torch.Tensor, origin: torch.Tensor, w: int) -> torch.Tensor:
    """Window id of each position (``origin`` broadcasts: [B, 1, 1] for [B, H, L] positions, or
    one value per entry); padding and empty slots (before the origin) land in window 0."""
    return torch.div((positions - origin).clamp(min=0), w, rounding_mode="floor")


def reduce_windows(scores: torch.Tensor, flat_window: torch.Tensor, size: int, how: str) -> torch.Tensor:
    """Per-window score from per-entry scores (finite entries only): sum, mean, max or logsumexp."""
    finite = torch.isfinite(scores)
    idx = flat_window[finite]
    s = scores[finite].double()
    if how == "max" or how == "logsumexp":
        top = torch.full((size,), float("-inf"), dtype=torch.float64, device=scores.device)
        top.scatter_reduce_(0, idx, s, reduce="amax")
        if how == "max":
            return top
        total = torch.zeros(size, dtype=torch.float64, device=scores.device)
        total.index_add_(0, idx, torch.exp(s - top[idx]))
        return top + torch.log(total)
    total = torch.zeros(size, dtype=torch.float64, device=scores.device).index_add_(0, idx, s)
    if how == "sum":
        return total
    if how == "mean":
        count = torch.zeros(size, dtype=torch.float64, device=scores.device).index_add_(0, idx, torch.ones_like(s))
        return total / count.clamp(min=1)
    raise ValueError(f"unknown window reduction {how!r}")


def window_value(score: torch.Tensor, how: str) -> torch.Tensor:
    """Linear worth of each window from its reduced score: summed attention as it is, summed log
    retention exponentiated (both additive over tokens, so values compare within a group)."""
    if how == "sum":
        return score.clamp(min=0).nan_to_num(0.0, posinf=0.0, neginf=0.0)
    if how == "logsumexp":
        return torch.exp(score).nan_to_num(0.0, posinf=0.0)
    raise ValueError(f"int2_value needs additive window scores (sum or logsumexp), not {how!r}")


def row_groups(mode: str, layer: int, B: int, H: int, device: torch.device) -> torch.Tensor:
    """[B * H] the ranking group of each (batch, kv head) row of one layer: the whole sequence
    ("global"), the (layer, batch) pair ("layer", AdaKV) or the row itself ("row")."""
    rows = torch.arange(B * H, device=device)
    if mode == "global":
        return rows // H
    if mode == "layer":
        return layer * B + rows // H
    return layer * B * H + rows


def gather_windows(fp: PaddedView, source: EntrySource, demote: torch.Tensor, w: int, Wn: int, state_names,
                   origin: torch.Tensor, rope=None, keep_original: bool = False) -> "WindowEntries | None":
    """The FP entries marked in ``demote`` (laid out like ``fp``, their keys and values read from
    ``source``), gathered per window ([n, w, ...], by slot; ``origin`` [B]: each sequence's first real
    position); with ``keep_original`` also the keys as cached (post-RoPE) for the spill tier."""
    b, h, l = torch.nonzero(demote, as_tuple=True)
    if b.numel() == 0:
        return None
    H = fp.positions.shape[1]
    pos = fp.positions[b, h, l]
    row = b * H + h
    wid = window_of(pos, origin[b], w)
    key, inverse = torch.unique(row * Wn + wid, return_inverse=True)
    n = key.numel()
    slot = pos - origin[b] - wid * w
    cached_keys, cached_values = source.read(b, h, l)
    D = cached_keys.shape[-1]
    dev = cached_keys.device
    entry_keys = cached_keys
    if rope is not None:  # quantize pre-RoPE keys (rotated back at each entry's position)
        entry_keys = rope.unrotate(entry_keys, pos)
    keys = torch.zeros(n, w, D, dtype=entry_keys.dtype, device=dev)
    values = torch.zeros(n, w, D, dtype=cached_values.dtype, device=dev)
    keys[inverse, slot] = entry_keys
    values[inverse, slot] = cached_values
    present = torch.zeros(n, w, dtype=torch.bool, device=dev)
    present[inverse, slot] = True
    # empty slots (evicted or padding before the first token) copy a present entry so the
    # window's min-max grid is the present entries'
    first = present.float().argmax(dim=1)
    ar = torch.arange(n, device=dev)
    keys = torch.where(present[..., None], keys, keys[ar, first][:, None])
    values = torch.where(present[..., None], values, values[ar, first][:, None])
    original_keys = None
    if keep_original:
        if rope is None:
            original_keys = keys  # the cached keys themselves (empty slots are never restored)
        else:
            original_keys = torch.zeros(n, w, D, dtype=cached_keys.dtype, device=dev)
            original_keys[inverse, slot] = cached_keys
    positions = torch.full((n, w), -1, dtype=torch.int32, device=dev)
    positions[inverse, slot] = pos.to(torch.int32)
    modality = torch.zeros(n, w, dtype=torch.uint8, device=dev)
    modality[inverse, slot] = fp.modality[b, h, l]
    state = {}
    for name in state_names:
        s = torch.zeros(n, w, dtype=torch.float32, device=dev)
        s[inverse, slot] = fp.state[name][b, h, l]
        state[name] = s
    return WindowEntries(keys, values, key // Wn, key % Wn, positions, modality, state, original_keys)


@dataclass
class WindowEntries:
    """FP entries gathered per window: [n, w, ...] by slot, positions -1 where a slot is empty."""

    keys: torch.Tensor
    values: torch.Tensor
    row: torch.Tensor
    window_id: torch.Tensor
    positions: torch.Tensor
    modality: torch.Tensor
    state: dict[str, torch.Tensor]
    original_keys: torch.Tensor | None = None  # keys as cached (post-RoPE), for the spill tier
