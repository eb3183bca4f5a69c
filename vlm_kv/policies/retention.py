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
    ``score_is_per_entry``).

    ``share_heads``: every KV head of a layer scores a position by the best retention any head of
    that layer gives it, so a token one head keeps is kept (or dropped) by all of them together.
    Why: at 0.05 the untiered gates kept planted codes piecemeal, a few digits in a few heads, while
    KVzip, which keeps fewer heads' worth of whole tokens, answered more (docs/retrieval.md, sessions
    28-30). Off by default (the reference); see docs/retrieval.md, session 34, for what it measured."""

    name: ClassVar[str] = "retention"
    state_names: ClassVar[tuple[str, ...]] = ("log_beta",)
    window_reduce: ClassVar[str] = "logsumexp"  # scores are log retentions: a window retains their sum
    score_reads_keys: ClassVar[bool] = False  # gate outputs and positions only
    num_sinks: int = 4
    span: int = 1
    share_heads: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.span, int) or isinstance(self.span, bool) or self.span < 1 or self.span % 2 == 0:
            raise ValueError(f"span must be an odd int >= 1 (entries centred on each one), got {self.span!r}")
        if not isinstance(self.share_heads, bool):
            raise ValueError(f"share_heads must be a bool, got {self.share_heads!r}")  # noqa: TRY004 (config errors are ValueErrors)

    @property
    def score_is_per_entry(self) -> bool:  # type: ignore[override]
        return self.span == 1 and not self.share_heads

    @property
    def sinks(self) -> int:
        return self.num_sinks

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        scores = retention_scores(ctx.view.state["log_beta"], ctx.view.positions, ctx.seen)
        # empty slots must not lend their neighbours (or the other heads) a score
        if self.span > 1:
            scores = pool_along_entries(scores.masked_fill(~ctx.view.valid, float("-inf")), self.span, "max")
        if self.share_heads:
            scores = best_over_heads(scores, ctx.view.positions, ctx.view.valid)
        return scores


def best_over_heads(scores: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Each valid entry's score replaced by the best score any head of its row gives the same
    position; the heads may hold different positions at different slots (ragged stores), so this
    matches by position, not by slot. scores, positions, valid: [B, H, L]; empty slots keep theirs."""
    b, h, n = scores.shape
    if n == 0:
        return scores
    pos = torch.where(valid, positions, torch.zeros_like(positions)).long().reshape(b, h * n)
    own = scores.masked_fill(~valid, float("-inf")).reshape(b, h * n)
    best = torch.full((b, int(pos.max()) + 1), float("-inf"), dtype=scores.dtype, device=scores.device)
    best = best.scatter_reduce(1, pos, own, reduce="amax", include_self=True)
    shared = best.gather(1, pos).view(b, h, n)
    return torch.where(valid, shared, scores)
