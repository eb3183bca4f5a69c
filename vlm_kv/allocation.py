"""How a budget is spread over layers and KV heads at an eviction step.

Every allocation receives, per layer, scores [B, H, L] (protected entries at +inf, empty slots
at -inf) and the per-head capacity ``cap[b]``; it returns keep masks holding at most
``layers * heads * cap[b]`` entries per sequence in total.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


def top_k_mask(scores: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Mask of the ``k`` best entries along the last dim; ``k`` broadcasts over leading dims.

    Exact counts (ties broken by order), and never an empty slot (-inf) unless k exceeds the
    valid entries, in which case the caller's validity mask removes them.
    """
    order = torch.argsort(scores, dim=-1, descending=True, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(scores.shape[-1], device=scores.device).expand_as(order))
    while k.dim() < scores.dim():
        k = k.unsqueeze(-1)
    return (ranks < k) & (scores > float("-inf"))


class Allocation:
    name: ClassVar[str] = "base"
    is_global: ClassVar[bool] = False

    def layer_capacity(self, layer_idx: int, num_layers: int, cap: torch.Tensor, window: int) -> torch.Tensor:
        """Per-head capacity of one layer ([B]); the layer allocations override this."""
        return cap

    def keep_layer(self, scores: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def keep_all(self, scores: list[torch.Tensor], cap: torch.Tensor) -> list[torch.Tensor]:
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

    def layer_capacity(self, layer_idx: int, num_layers: int, cap: torch.Tensor, window: int) -> torch.Tensor:
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
    """One top-k over every layer and head of a sequence: L * H * C entries in all
    (optionally at least ``min_per_head`` per head). Needs scores comparable across layers,
    which weight-coupled retention gates provide."""

    name: ClassVar[str] = "global"
    is_global: ClassVar[bool] = True
    min_per_head: int = 0

    def keep_all(self, scores: list[torch.Tensor], cap: torch.Tensor) -> list[torch.Tensor]:
        b = scores[0].shape[0]
        heads = sum(s.shape[1] for s in scores)
        shapes = [s.shape for s in scores]
        bases = [top_k_mask(s, torch.full((b, 1), self.min_per_head, dtype=torch.long, device=s.device))
                 if self.min_per_head > 0 else torch.zeros_like(s, dtype=torch.bool) for s in scores]
        flat = torch.cat([s.masked_fill(m, float("-inf")).reshape(b, -1) for s, m in zip(scores, bases)], dim=1)
        taken = sum(m.reshape(b, -1).sum(dim=1) for m in bases)
        extra = top_k_mask(flat, (cap * heads - taken).clamp(min=0).view(-1))
        out, start = [], 0
        for shape, base in zip(shapes, bases):
            n = shape[1] * shape[2]
            out.append(base | extra[:, start : start + n].reshape(shape))
            start += n
        return out


ALLOCATIONS = {cls.name: cls for cls in (Uniform, Pyramid, HeadAdaptive, GlobalTopK)}
