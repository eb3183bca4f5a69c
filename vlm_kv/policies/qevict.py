"""QEvict's scorer: H2O window mass with sinks, a quarter of the budget as the local FP zone.

Facts from ../shared/specs/tiered-int2.md (the QEvict paper's design): a window's score is the
attention mass its tokens accumulated over every query so far (H2O style), averaged over the
query heads of a GQA group; sinks (the first 4 tokens) and a local zone of 0.25 of the budget
always stay in full precision. The policy ``qevict`` routes FP / INT2 / evicted windows with it
(``make_cache(model, "qevict", budget)`` turns the tiers on by itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vlm_kv.policies.h2o import H2O


@dataclass
class QEvictScorer(H2O):
    name: ClassVar[str] = "qevict"
    recent_ratio: float = 0.25
    num_sinks: int = 4

    @property
    def sinks(self) -> int:
        return self.num_sinks
