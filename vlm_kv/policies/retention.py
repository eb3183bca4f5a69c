from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vlm_kv.gates.retention_gate import retention_scores
from vlm_kv.policies.base import ScoreContext, Scorer, pool_along_entries


@dataclass
class RetentionScorer(Scorer):
    """Learned retention: score = (t - i) * log beta_i, where a gate predicted beta_i from the
    hidden state that produced entry i (TrimKV, Bui et al. 2025; DBTrimKV couples the gates so
    scores compare across layers and heads, which the global allocation relies on).

    ``num_sinks`` first tokens are always kept (attention sinks, as in StreamingLLM). Gates
    trained on short sequences do not learn that the first tokens must outlive thousands of
    steps; protecting them cuts SmolLM2's KL at a 0.1 budget 4.8-fold (0.342 -> 0.071 in the
    README's fidelity table).
    ``num_sinks=0`` gives the reference behaviour.

    ``span``: an entry scores the best retention of the ``span`` entries centred on it, along each
    head's stored order (max pooling, as SnapKV smooths its scores; 1: off, the reference). Why:
    the gates score tokens one by one, and on 2048-token retrieval trials at 0.05 the untiered
    cache kept some digits of a planted code but not all (docs/retrieval.md, session 30); a pooled
    score was to keep a fact's neighbours with it. Measured there: 7 of 24 facts at 0.05 with span 5
    against 8 without (the budget goes to every well-retained token's neighbours), so it stays off by
    default. Scores then depend on the neighbours, so a global
    step cannot drop entries layer by layer during a prefill (the evictor checks
    ``score_is_per_entry``)."""

    name: ClassVar[str] = "retention"
    state_names: ClassVar[tuple[str, ...]] = ("log_beta",)
    window_reduce: ClassVar[str] = "logsumexp"  # scores are log retentions: a window retains their sum
    score_reads_keys: ClassVar[bool] = False  # gate outputs and positions only
    num_sinks: int = 4
    span: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.span, int) or isinstance(self.span, bool) or self.span < 1 or self.span % 2 == 0:
            raise ValueError(f"span must be an odd int >= 1 (entries centred on each one), got {self.span!r}")

    @property
    def score_is_per_entry(self) -> bool:  # type: ignore[override]
        return self.span == 1

    @property
    def sinks(self) -> int:
        return self.num_sinks

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        scores = retention_scores(ctx.view.state["log_beta"], ctx.view.positions, ctx.seen)
        if self.span == 1:
            return scores
        # empty slots must not lend their neighbours a score
        return pool_along_entries(scores.masked_fill(~ctx.view.valid, float("-inf")), self.span, "max")
