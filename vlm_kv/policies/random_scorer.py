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
        valid = ctx.view.valid
        b, h, _ = valid.shape
        generators = ctx.generator if isinstance(ctx.generator, list) else [ctx.generator] * b
        # each sequence draws from its own generator as many numbers as it holds entries, and an
        # entry takes the number of its place among them: the draws a sequence gets alone, whatever
        # else is in the batch (padding only widens the view)
        place = (valid.long().cumsum(-1) - 1).clamp(min=0).cpu()
        out = torch.zeros(valid.shape, dtype=torch.float32)
        for row, generator in enumerate(generators):
            n = max(int(valid[row].sum(-1).max()), 1)
            draws = torch.rand((1, h, n), generator=generator, device="cpu")[0]
            out[row] = draws.gather(-1, place[row].clamp(max=n - 1))
        return out.to(valid.device)
