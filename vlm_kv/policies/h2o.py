from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vlm_kv.attention.reference import attention_received
from vlm_kv.policies.base import ScoreContext, Scorer


@dataclass
class H2O(Scorer):
    """Heavy hitters: attention each entry received, summed over every query so far, plus a
    recent window holding ``recent_ratio`` of the capacity.

    Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference" (2023); the
    reference splits the budget evenly between heavy and recent tokens.
    """

    name: ClassVar[str] = "h2o"
    state_names: ClassVar[tuple[str, ...]] = ("attn_sum",)
    recent_ratio: float = 0.5
    score_reads_keys: ClassVar[bool] = False  # the attention summed in state ("attn_sum")
    score_is_per_entry: ClassVar[bool] = True

    def protected_window(self, capacity: int) -> int:
        return int(self.recent_ratio * capacity)

    uses_received_attention: ClassVar[bool] = True

    def observe(self, store, query, view, query_positions, scaling) -> None:
        store.add_state("attn_sum", attention_received(query, view, query_positions, scaling))

    def observe_received(self, store, body, tail) -> None:
        store.add_state_split("attn_sum", body, tail)

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        return ctx.view.state["attn_sum"]
