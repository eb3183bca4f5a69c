from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vlm_kv.policies.base import ScoreContext, Scorer


@dataclass
class StreamingLLM(Scorer):
    """Keep the first ``num_sinks`` tokens (attention sinks) and the most recent ones.

    Xiao et al., "Efficient Streaming Language Models with Attention Sinks" (2023).
    """

    name: ClassVar[str] = "streaming_llm"
    window_reduce: ClassVar[str] = "max"  # recency: a window is as recent as its newest entry
    num_sinks: int = 4

    @property
    def sinks(self) -> int:
        return self.num_sinks

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        return ctx.view.positions.float()
