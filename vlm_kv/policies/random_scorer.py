from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vlm_kv.policies.base import ScoreContext, Scorer


@dataclass
class RandomScorer(Scorer):
    """Uniformly random scores: the floor any real policy must clear."""

    name: ClassVar[str] = "random"
    window_reduce: ClassVar[str] = "mean"

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        shape = ctx.view.positions.shape
        return torch.rand(shape, generator=ctx.generator, device="cpu").to(ctx.view.positions.device)
