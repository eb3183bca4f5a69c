"""Group accounting shared by the window router and the entry router.

Both rank candidates (windows, or entries) in one list per *group* and spend each group's bytes by
rank. A group is one (layer, batch, kv head) row for per-head allocations, one (layer, batch) for
AdaKV's head-adaptive one, and one whole sequence for a global allocation. This module holds what
the two routers do alike: which group each row is in and how many bytes it holds
(``GroupBytes``), the ranking of candidates within their groups and the sums along it
(``Ranking``), and laying the flat decisions back out per layer (``per_layer``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from vlm_kv.storage.allocation import Allocation, HeadAdaptive
from vlm_kv.storage.ordering import descending_order
from vlm_kv.tiers.routing import LayerRouting, RoutedLayer
from vlm_kv.tiers.windows import EVICT, row_groups


def segment_counts(index: torch.Tensor, size: int) -> torch.Tensor:
    """[size] how many times each value of ``index`` occurs."""
    return torch.zeros(size, dtype=torch.long, device=index.device).index_add_(0, index, torch.ones_like(index))


def exclusive_cumsum(counts: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(counts, 0) - counts


def group_mode(allocation: Allocation) -> str:
    """How rows form ranking groups under ``allocation`` (``windows.row_groups``' mode)."""
    return "global" if allocation.is_global else "layer" if isinstance(allocation, HeadAdaptive) else "row"


@dataclass(frozen=True)
class GroupBytes:
    """The ranking groups of one routing event and the bytes ``M`` each holds: the budget's tokens
    of its rows times their FP bytes per token."""

    rows: list[torch.Tensor]  # per layer: [B * H] group of each (batch, kv head) row
    budget: torch.Tensor      # [count] bytes per group
    count: int
    batch_size: int
    num_kv_heads: int

    @classmethod
    def of(cls, allocation: Allocation, layers: Sequence[RoutedLayer], routings: Sequence[LayerRouting]) -> "GroupBytes":
        mode = group_mode(allocation)
        device = routings[0].scores.device
        B, H = routings[0].scores.shape[:2]
        rows, row_bytes = [], []
        for li, (layer, r) in enumerate(zip(layers, routings)):
            rows.append(row_groups(mode, li, B, H, device))
            row_bytes.append(r.cap.view(B, 1).expand(B, H).reshape(-1) * layer.store.bytes_per_entry)
        all_rows = torch.cat(rows)
        count = int(all_rows.max()) + 1
        budget = torch.zeros(count, dtype=torch.long, device=device).index_add_(0, all_rows, torch.cat(row_bytes))
        return cls(rows, budget, count, B, H)

    def sequence_of_groups(self) -> torch.Tensor:
        """[count] the batch index of each group (every group lies in one sequence)."""
        device = self.budget.device
        batch = torch.arange(self.batch_size * self.num_kv_heads, device=device) // self.num_kv_heads
        all_rows = torch.cat(self.rows)
        return torch.zeros(self.count, dtype=torch.long, device=device).index_put_(
            (all_rows,), batch.repeat(len(self.rows)))

    def total(self, group: torch.Tensor, amount: torch.Tensor) -> torch.Tensor:
        """[count] ``amount`` summed per group (``group`` [N] of each amount)."""
        return torch.zeros(self.count, dtype=torch.long, device=group.device).index_add_(0, group, amount)

    def fallback_rows(self, fallback_group: torch.Tensor) -> list[torch.Tensor]:
        """Per layer: [B, H] rows whose group falls back to the entry rule."""
        return [fallback_group[rows].view(self.batch_size, self.num_kv_heads) for rows in self.rows]


@dataclass(frozen=True)
class Ranking:
    """Candidates ordered by group, then by descending score within it (stable: ties keep their
    order). Quantities "in ranked order" are indexed by ranked place ``0 .. N - 1``."""

    order: torch.Tensor   # [N] the candidate at each ranked place
    group: torch.Tensor   # [N] its group
    counts: torch.Tensor  # [groups] candidates per group
    start: torch.Tensor   # [groups] first ranked place of each group
    rank: torch.Tensor    # [N] place within its group (0: the best)
    groups: int

    @classmethod
    def by_score(cls, group: torch.Tensor, score: torch.Tensor, groups: int) -> "Ranking":
        by_score = descending_order(score)
        # one group (a global ranking of one sequence): the second stable sort would keep this order
        order = by_score if groups == 1 else by_score[torch.argsort(group[by_score], stable=True)]
        g = group[order]
        counts = segment_counts(g, groups)
        start = exclusive_cumsum(counts)
        rank = torch.arange(g.numel(), device=g.device)
        if groups > 1:
            rank -= start[g]
        return cls(order, g, counts, start, rank, groups)

    def spread(self, x: torch.Tensor) -> torch.Tensor:
        """[N] each ranked place's value of the per-group ``x`` [groups] (a view when there is one
        group: a global ranking gathers nothing)."""
        return x.expand(self.group.numel()) if self.groups == 1 else x[self.group]

    def totals(self, x: torch.Tensor) -> torch.Tensor:
        """[groups] ``x`` (in ranked order) summed per group."""
        return torch.zeros(self.groups, dtype=x.dtype, device=x.device).index_add_(0, self.group, x)

    def cumsum(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inclusive prefix sums of ``x`` (in ranked order) within each group, and the group totals."""
        total = self.totals(x)
        return torch.cumsum(x, 0) - self.spread(exclusive_cumsum(total)), total

    def unrank(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` (in ranked order) back in the candidates' order."""
        result = torch.empty_like(out)
        result[self.order] = out
        return result


def per_layer(decision: torch.Tensor, layer: torch.Tensor, index: torch.Tensor,
              shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    """Flat decisions of candidates from every layer (``layer`` [N] and flat ``index`` [N] of each)
    laid out per layer in ``shapes``; what no candidate covers is EVICT."""
    out = []
    # candidates come layer after layer (cat_records of per-layer records): slice them where they do
    counts = torch.bincount(layer, minlength=len(shapes)).tolist() if layer.numel() else [0] * len(shapes)
    in_order = layer.numel() < 2 or bool((layer[1:] >= layer[:-1]).all())
    start = 0
    for li, shape in enumerate(shapes):
        if in_order:
            mine = slice(start, start + counts[li])
            start += counts[li]
        else:
            mine = layer == li
        dec = torch.full((math.prod(shape),), EVICT, dtype=torch.long, device=decision.device)
        dec[index[mine]] = decision[mine]
        out.append(dec.view(shape))
    return out


R = TypeVar("R")


def cat_records(parts: Sequence[R]) -> R:
    """One record from per-layer records of the same dataclass: each tensor field concatenated
    (fields that are None in every part stay None)."""
    first = parts[0]
    merged = {}
    for f in dataclasses.fields(first):
        values = [getattr(p, f.name) for p in parts]
        merged[f.name] = None if values[0] is None else torch.cat(values)
    return type(first)(**merged)
