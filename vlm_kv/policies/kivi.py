"""KIVI-2 as a baseline for the tiers: every token outside the sinks and a recent residual is
held in INT2, nothing is evicted.

Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache" (2024): keys are
quantized per channel over groups of tokens, values per token, with the most recent tokens kept
in full precision (the residual) until a group fills. Here a group is one window of the tiered
cache (``window`` tokens, 32 in KIVI's setup), and the residual holds ``residual`` tokens. The
cache's bytes are what this needs: ``make_cache(model, "kivi2")`` takes budget 1.0 and the
report says what it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vlm_kv.storage.allocation import Uniform
from vlm_kv.policies.base import ScoreContext, Scorer


@dataclass
class KIVI2Scorer(Scorer):
    name: ClassVar[str] = "kivi2"
    window_reduce: ClassVar[str] = "max"
    score_reads_keys: ClassVar[bool] = False  # positions only
    score_is_per_entry: ClassVar[bool] = True
    num_sinks: int = 4
    residual: int = 128

    @property
    def sinks(self) -> int:
        return self.num_sinks

    def protected_window(self, capacity: int) -> int:
        return self.residual

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        return ctx.view.positions.float()


@dataclass
class QuantizeEverything(Uniform):
    """Holds every token (nothing is evicted); its memory is whatever INT2 needs."""

    name: ClassVar[str] = "quantize_all"
    bounded_by_budget: ClassVar[bool] = False
