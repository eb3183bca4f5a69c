from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vlm_kv.policies.base import ScoreContext, Scorer


@dataclass
class TOVA(Scorer):
    """Attention from the current (last) query, averaged over heads.

    Oren et al., "Transformers are Multi-State RNNs" (2024). When every KV head of a layer holds
    the same positions (the usual case, TOVA keeps them aligned), the average spans all heads of
    the layer; otherwise the query heads sharing a KV head.
    """

    name: ClassVar[str] = "tova"

    @property
    def query_window(self) -> int:
        return 1

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        scores = ctx.window_attention().mean(dim=2)  # [B, H, L]
        pos = ctx.view.positions
        if scores.shape[1] > 1 and bool((pos == pos[:, :1]).all()):
            scores = scores.mean(dim=1, keepdim=True).expand_as(scores)
        return scores
