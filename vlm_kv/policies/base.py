"""What every eviction scorer shares: the context it scores in and the protected entries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vlm_kv.attention.reference import attention_probs
from vlm_kv.storage.store import PaddedView


@dataclass
class ScoreContext:
    """Everything a scorer may look at for one layer at an eviction step."""

    layer_idx: int
    num_layers: int
    view: PaddedView                       # stored entries, [B, H, L] layout
    window_queries: torch.Tensor | None    # [B, Hq, w, D] most recent queries of this layer
    window_positions: torch.Tensor | None  # [w]
    scaling: float | None
    seen: int                              # tokens seen so far (the next position)
    capacity: torch.Tensor                 # [B] average tokens per head this step keeps
    # random draws: one generator per sequence (each draws what it would alone), or one for all
    generator: "torch.Generator | list[torch.Generator] | None" = None

    def window_attention(self) -> torch.Tensor:
        """Attention of the remembered queries on every entry, summed over queries: [B, H, g, L]."""
        if self.window_queries is None or self.window_queries.shape[2] == 0:
            raise RuntimeError("this scorer needs recent queries but the layer kept none")
        probs = attention_probs(self.window_queries, self.view, self.window_positions, self.scaling)
        return probs.sum(dim=3)


class Scorer:
    """Scores the entries of one layer; higher means keep.

    Subclasses are dataclasses with their parameters. Class attributes say what the cache must
    record for them: ``state_names`` (per-entry state kept beside each entry) and
    ``query_window`` (how many recent queries each layer remembers).
    """

    name: ClassVar[str] = "base"
    state_names: ClassVar[tuple[str, ...]] = ()
    #: ``score`` reads the view's keys (or attention over them). True unless a scorer says
    #: otherwise, so that a scorer nobody checked never scores an empty key tensor; False lets a
    #: tiered cache's routing events skip dequantizing every INT2 key just to score it
    score_reads_keys: ClassVar[bool] = True
    #: an entry's score depends on that entry alone (not on its neighbours along the positions, as
    #: SnapKV's pooling does): a routing event then scores the entries in the order they lie instead
    #: of sorting each row by position first. False unless a scorer says otherwise (fail closed)
    score_is_per_entry: ClassVar[bool] = False
    #: how a tiered cache turns entry scores into one score per window: "sum" for additive
    #: masses (attention), "logsumexp" for log-domain scores, "max" / "mean" otherwise
    window_reduce: ClassVar[str] = "sum"

    @property
    def query_window(self) -> int:
        return 0

    def for_layer(self, layer_idx: int) -> "Scorer":
        """The scorer layer ``layer_idx`` uses; per-layer policies return a different one per layer."""
        return self

    def for_phase(self, phase: str) -> "Scorer":
        """The scorer an eviction step after a ``phase`` forward ("prefill": several tokens, "decode")
        scores with; per-phase policies return a different one per phase."""
        return self

    @property
    def sinks(self) -> int:
        return 0

    def protected_window(self, capacity: int) -> int:
        """Most recent tokens always kept, for a head capacity of ``capacity`` tokens."""
        return 0

    def observe(self, store, query: torch.Tensor, view: PaddedView, query_positions: torch.Tensor,
                scaling: float | None) -> None:
        """Called after every attention call of a layer that has several queries (prefill), and
        after decode steps too unless the scorer takes ``observe_received`` instead."""

    #: the scorer accumulates the attention entries receive at decode steps; the decode path
    #: then hands it over with ``observe_received`` (computed during attention, no extra pass)
    uses_received_attention: ClassVar[bool] = False

    def observe_received(self, store, body: torch.Tensor | None, tail: torch.Tensor) -> None:
        """Attention the entries received from one decode query: body [N] (body order), tail [B, H, T]."""

    @property
    def observes(self) -> bool:
        return type(self).observe is not Scorer.observe

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        raise NotImplementedError


def protected_counts(scorer: "Scorer", capacity: int) -> tuple[int, int]:
    """(sinks, recent window) a scorer protects within ``capacity`` tokens per head.

    A policy's protected zone never outgrows the budget: sinks come first, and the recent
    window shrinks to what is left, so a fraction budget works at every prompt length.
    """
    sinks = min(scorer.sinks, max(capacity, 0))
    window = min(scorer.protected_window(capacity), max(capacity - sinks, 0))
    return sinks, window


def protect(
    scores: torch.Tensor,
    view: PaddedView,
    sinks: "int | torch.Tensor",
    windows: torch.Tensor,
    first_positions: torch.Tensor,
    seen: int,
) -> torch.Tensor:
    """Sinks and recent windows to +inf, empty slots to -inf. sinks (int or [B]), windows, first_positions: [B]."""
    pos = view.positions
    scores = scores.float()
    b = pos.shape[0]
    sinks = torch.as_tensor(sinks, device=pos.device).expand(b)
    protected = (pos - first_positions.view(-1, 1, 1)) < sinks.view(-1, 1, 1)
    protected |= pos >= (seen - windows).view(-1, 1, 1)
    scores = torch.where(protected, torch.full_like(scores, float("inf")), scores)
    return scores.masked_fill(~view.valid, float("-inf"))


def pool_along_entries(scores: torch.Tensor, kernel: int, mode: str = "avg") -> torch.Tensor:
    """1-D pooling of [B, H, L] scores along each head's stored order (SnapKV's smoothing)."""
    if kernel <= 1:
        return scores
    b, h, length = scores.shape
    flat = scores.reshape(b * h, 1, length)
    if mode == "max":
        pooled = torch.nn.functional.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    else:
        pooled = torch.nn.functional.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    return pooled[..., :length].reshape(b, h, length)
