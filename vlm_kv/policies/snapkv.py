from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vlm_kv.policies.base import ScoreContext, Scorer, pool_along_entries


@dataclass
class SnapKV(Scorer):
    """Attention from an observation window of the last ``window`` queries, summed over the
    window, averaged over the query heads of a GQA group, smoothed by 1-D pooling; the window's
    own tokens are always kept.

    Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation" (2024). At decode
    time the same rule runs on the most recent queries, which each layer remembers.
    """

    name: ClassVar[str] = "snapkv"
    window: int = 32
    kernel: int = 7
    pooling: str = "avg"

    @property
    def query_window(self) -> int:
        return self.window

    def protected_window(self, capacity: int) -> int:
        return self.window

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        scores = ctx.window_attention().mean(dim=2)
        scores = scores.masked_fill(~ctx.view.valid, 0.0)
        return pool_along_entries(scores, self.kernel, self.pooling)
