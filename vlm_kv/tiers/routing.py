"""What a routing event hands its router: each layer's entries and windows (``LayerRouting``), and
the protocol both routers follow (``RouterStrategy``: ``decide`` over every layer at once, then
``apply`` per layer)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from vlm_kv.policies.base import Scorer
from vlm_kv.storage.allocation import Allocation, top_k_mask
from vlm_kv.storage.store import EntrySource, PaddedView, VarlenKVStore
from vlm_kv.tiers.int2_tier import Int2Tier
from vlm_kv.tiers.windows import FP, INT2, window_of


class RoutedLayer(Protocol):
    """What a router reads and rebuilds of a cache layer (the cache's tiered layer)."""

    layer_idx: int
    seen: int
    store: VarlenKVStore
    tier: Int2Tier

    def num_entries(self) -> int: ...


@dataclass
class LayerRouting:
    """One layer's entries and windows at a routing event."""

    fp: PaddedView                 # FP entries' metadata (keys only where the scorer reads them), store layout
    source: EntrySource            # the FP entries' keys and values, read where they lie (those an event moves)
    tier_slot: torch.Tensor        # [B, H, Lq] ledger slot of each INT2 entry (-1 empty)
    scores: torch.Tensor           # [B, H, Lf + Lq] protected +inf, empty -inf
    positions: torch.Tensor        # [B, H, Lf + Lq]
    valid: torch.Tensor
    num_windows: int               # windows per row (ceil(seen / w): the most any sequence has)
    cap: torch.Tensor              # [B] tokens per head this layer may hold
    origin: torch.Tensor           # [B] position of each sequence's first real token: where its windows start
    window: int                    # tokens per window
    budget_fraction: torch.Tensor  # [B] float64: each sequence's capacity over its real tokens
    # [B * H * Wn] windows quantized early in this event (a global ranking's prefill, see
    # vlm_kv.tiers.global_prefill) that the ledger did not hold before it; None: no such window
    provisional: torch.Tensor | None = None

    def window_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """Window id of [B, H, L] positions, counted from each sequence's origin."""
        return window_of(positions, self.origin.view(-1, 1, 1), self.window)

    def incomplete(self, wid: torch.Tensor, seen: int) -> torch.Tensor:
        """Windows some of whose positions are not seen yet ([B, H, L] ids)."""
        return (wid + 1) * self.window > seen - self.origin.view(-1, 1, 1)

    def forced(self, seen: int) -> torch.Tensor:
        """[B, H, Lf + Lq] entries that stay FP whatever the budget: protected (+inf) or in a window
        not complete yet."""
        wid = self.window_ids(self.positions)
        return self.valid & ((self.scores == float("inf")) | self.incomplete(wid, seen))

    def window_keys(self, tier: Int2Tier) -> torch.Tensor:
        """[len(tier)] each ledger window's flat (row, window) index, ``row * Wn + window id``."""
        return tier.row * self.num_windows + tier.window_id

    def fp_moves(self, dec_fp: torch.Tensor, fallback: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(keep, demote) masks of the FP entries given their decisions ``dec_fp`` [B, H, Lf] and the
        fallback rows [B, H]: a fallback row keeps its best FP-decided entries up to its capacity
        and demotes nothing."""
        fp_valid = self.fp.valid
        rows_fallback = fallback[..., None]
        keep = fp_valid & (dec_fp == FP) & ~rows_fallback
        if bool(fallback.any()):
            pinned = fp_valid & (dec_fp == FP)
            pick = top_k_mask(self.scores[..., : self.fp.length].masked_fill(~pinned, float("-inf")),
                              self.cap.view(-1, 1))
            keep = keep | (pick & pinned & rows_fallback)
        demote = fp_valid & (dec_fp == INT2) & ~rows_fallback
        return keep, demote

    def ledger_lookup(self, tier: Int2Tier) -> torch.Tensor:
        """[B * H * Wn] the ledger index of each (row, window), -1 where the ledger has none."""
        B, H = self.scores.shape[:2]
        Wn = self.num_windows
        lookup = torch.full((B * H * max(Wn, 1),), -1, dtype=torch.long, device=self.scores.device)
        if len(tier):
            lookup[self.window_keys(tier)] = torch.arange(len(tier), device=self.scores.device)
        return lookup


class RouterStrategy(Protocol):
    """How a routing event splits entries between FP, INT2 and eviction (``fp_unit``)."""

    def decide(self, layers: Sequence[RoutedLayer], routings: Sequence[LayerRouting], allocation: Allocation,
               scorer: Scorer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer: decisions (FP / INT2 / EVICT, laid out as the strategy's ``apply`` reads them)
        and [B, H] fallback rows."""
        ...

    def apply(self, layer: RoutedLayer, routing: LayerRouting, decision: torch.Tensor, fallback: torch.Tensor) -> None:
        """Carry out one layer's decisions: rebuild its FP store and its tier."""
        ...

    def apply_all(self, layers: Sequence[RoutedLayer], routings: Sequence[LayerRouting],
                  decisions: Sequence[torch.Tensor], fallback: Sequence[torch.Tensor]) -> None:
        """``apply`` for every layer of an event (the same result as one call per layer)."""
        ...
