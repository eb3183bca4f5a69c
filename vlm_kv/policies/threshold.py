"""Threshold mode for retention gates: no fixed budget, memory follows the content.

TrimKV / DBTrimKV (Bui et al. 2025, see ../shared/specs/retention-gates.md) also offer a
threshold rule: at each eviction step an entry stays while its retention score
``(t - i) * log beta_i >= log alpha``, i.e. while its retention weight beta_i ** (t - i) is at
least alpha. How many entries that keeps depends on the text, so the cache is built with
``budget=1.0`` (nothing is cut for lack of room) and reports what it really holds through
``kv_bytes()`` / ``max_kv_bytes``; sinks and empty slots keep their usual treatment (+inf /
-inf from ``protect``).

    cache = make_cache(model, "dbtrimkv_threshold", budget=1.0, gates=DIR, allocation_kwargs={"log_alpha": -4.0})
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from vlm_kv.storage.allocation import Allocation


@dataclass
class RetentionThreshold(Allocation):
    """Keep every entry whose score is >= ``log_alpha`` (all layers and heads alike); the
    capacity the cache passes in is ignored, so use it with ``budget=1.0``."""

    name: ClassVar[str] = "threshold"
    is_global: ClassVar[bool] = True
    bounded_by_budget: ClassVar[bool] = False
    log_alpha: float = -4.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.log_alpha) and self.log_alpha <= 0):
            raise ValueError(f"log_alpha must be a finite number <= 0 (alpha in (0, 1]), got {self.log_alpha}")

    def keep_layer(self, scores: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
        return (scores >= self.log_alpha) & (scores > float("-inf"))

    def keep_all(self, scores: list[torch.Tensor], cap: torch.Tensor,
                 modality: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        return [self.keep_layer(s, cap) for s in scores]
