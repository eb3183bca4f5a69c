from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vlm_kv.policies.base import ScoreContext, Scorer


@dataclass
class KNorm(Scorer):
    """Keep keys with the smallest L2 norm (low-norm keys tend to draw high attention).

    Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression" (2024).
    """

    name: ClassVar[str] = "knorm"
    window_reduce: ClassVar[str] = "mean"

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        return -ctx.view.keys.float().norm(dim=-1)
