"""How a budget is spread over layers and KV heads at an eviction step.

Every allocation receives, per layer, scores [B, H, L] (protected entries at +inf, empty slots
at -inf) and the per-head capacity ``cap[b]``; it returns keep masks holding at most
``layers * heads * cap[b]`` entries per sequence in total.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from vlm_kv.models.adapters import MODALITIES
from vlm_kv.storage.ordering import descending_order


def top_k_mask(scores: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Mask of the ``k`` best entries along the last dim; ``k`` broadcasts over leading dims.

    Exact counts (ties broken by order), and never an empty slot (-inf) unless k exceeds the
    valid entries, in which case the caller's validity mask removes them.
    """
    order = descending_order(scores)
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(scores.shape[-1], device=scores.device).expand_as(order))
    while k.dim() < scores.dim():
        k = k.unsqueeze(-1)
    return (ranks < k) & (scores > float("-inf"))


class Allocation:
    name: ClassVar[str] = "base"
    is_global: ClassVar[bool] = False
    #: False for allocations whose memory follows the content (threshold mode): they take no budget
    bounded_by_budget: ClassVar[bool] = True

    def for_layer(self, layer_idx: int) -> "Allocation":
        """The allocation layer ``layer_idx`` uses; per-layer policies return a different one per layer."""
        return self

    def for_step(self, phase: str, valid_tokens: torch.Tensor) -> "Allocation":
        """The allocation one eviction step uses, told the phase ("prefill" or "decode") and each
        sequence's real tokens ([B]); per-phase policies return a different one per phase."""
        return self

    def layer_capacity(self, layer_idx: int, num_layers: int, cap: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        """Per-head capacity of one layer ([B]) for per-sequence capacities ``cap`` and protected
        recent windows ``window`` ([B]); the layer allocations override this."""
        return cap

    def keep_layer(self, scores: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def keep_all(self, scores: list[torch.Tensor], cap: torch.Tensor,
                 modality: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        raise NotImplementedError


@dataclass
class Uniform(Allocation):
    """Every layer and head keeps the same number of entries."""

    name: ClassVar[str] = "uniform"

    def keep_layer(self, scores: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
        return top_k_mask(scores, cap.view(-1, 1))


@dataclass
class Pyramid(Uniform):
    """Per-layer capacities decreasing linearly with depth (PyramidKV).

    Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
    Funneling" (2024): with window w and capacity C, min = (C - w) / beta, max = 2 (C - w) - min,
    layer l keeps w + max - l (max - min) / (L - 1). The mean over layers stays C.
    """

    name: ClassVar[str] = "pyramid"
    beta: float = 20.0

    def layer_capacity(self, layer_idx: int, num_layers: int, cap: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        if num_layers == 1:
            return cap
        free = (cap - window).clamp(min=0).double()
        low = free / self.beta
        high = 2 * free - low
        mine = high - layer_idx * (high - low) / (num_layers - 1)
        return window + torch.floor(mine).long()


@dataclass
class HeadAdaptive(Allocation):
    """AdaKV: within a layer, heads compete for H * C entries; each head keeps at least
    ``floor_ratio * C`` of its best entries.

    Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation" (2024).
    """

    name: ClassVar[str] = "adaptive"
    floor_ratio: float = 0.2

    def keep_layer(self, scores: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
        b, h, length = scores.shape
        floor = torch.floor(cap.double() * self.floor_ratio).long()
        base = top_k_mask(scores, floor.view(-1, 1))
        rest_k = cap * h - base.reshape(b, -1).sum(dim=1)
        rest = scores.masked_fill(base, float("-inf")).reshape(b, h * length)
        extra = top_k_mask(rest, rest_k.view(-1)).reshape(b, h, length)
        return base | extra


@dataclass
class GlobalTopK(Allocation):
    """One top-k over every layer and head of a sequence: L * H * C entries in all.

    Needs scores comparable across layers, which weight-coupled retention gates provide.
    Options: ``min_per_head`` entries every head keeps; ``modality_floor`` / ``modality_cap``
    map a modality ("text", "image", "video") to the least / most share of the sequence's budget
    (L * H * C entries) it gets. A floor only binds while that modality has entries left to keep;
    a cap is not refilled from that modality when the others run short, so the kept set can be
    smaller than the budget and that modality's share of what is kept above the cap.
    """

    name: ClassVar[str] = "global"
    is_global: ClassVar[bool] = True
    min_per_head: int = 0
    modality_floor: dict[str, float] = field(default_factory=dict)
    modality_cap: dict[str, float] = field(default_factory=dict)

    @property
    def is_plain(self) -> bool:
        """One top-k with no per-head minimum, floor or cap: each entry's fate depends only on how
        many entries outscore it (what a step taken layer by layer can bound early)."""
        return not self.min_per_head and not self.modality_floor and not self.modality_cap

    def keep_all(self, scores: list[torch.Tensor], cap: torch.Tensor,
                 modality: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        b = scores[0].shape[0]
        heads = sum(s.shape[1] for s in scores)
        shapes = [s.shape for s in scores]
        total = cap * heads  # [B] entries kept per sequence
        flat = torch.cat([s.reshape(b, -1) for s in scores], dim=1)
        taken = torch.zeros_like(flat, dtype=torch.bool)
        if self.min_per_head > 0:
            per_head = torch.full((b, 1), self.min_per_head, dtype=torch.long, device=flat.device)
            taken = torch.cat([top_k_mask(s, per_head).reshape(b, -1) for s in scores], dim=1)
        if self.modality_floor or self.modality_cap:
            if modality is None:
                raise ValueError("modality floors/caps need the entries' modality")
            mods = torch.cat([m.reshape(b, -1) for m in modality], dim=1)
            for name, share in self.modality_cap.items():
                code = MODALITIES.index(name)
                limit = torch.floor(total.double() * share).long()
                inside = mods == code
                allowed = top_k_mask(flat.masked_fill(~inside, float("-inf")), limit)
                flat = flat.masked_fill(inside & ~allowed, float("-inf"))
                taken &= ~(inside & ~allowed)
            for name, share in self.modality_floor.items():
                code = MODALITIES.index(name)
                need = torch.floor(total.double() * share).long() - (taken & (mods == code)).sum(1)
                pool = flat.masked_fill((mods != code) | taken, float("-inf"))
                taken |= top_k_mask(pool, need.clamp(min=0))
        rest = flat.masked_fill(taken, float("-inf"))
        extra = top_k_mask(rest, (total - taken.sum(1)).clamp(min=0))
        keep = taken | extra
        out, start = [], 0
        for shape in shapes:
            n = shape[1] * shape[2]
            out.append(keep[:, start : start + n].reshape(shape))
            start += n
        return out


ALLOCATIONS = {cls.name: cls for cls in (Uniform, Pyramid, HeadAdaptive, GlobalTopK)}
