from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from vlm_kv.policies.base import ScoreContext, Scorer


class MissingReconstructionScores(RuntimeError):
    """A kvzip cache was filled without its reconstruction pass."""


@dataclass
class KVzipScorer(Scorer):
    """Query-agnostic importance from context reconstruction: an entry is worth what the model
    needs to repeat the context from the cache. The model is prompted to repeat the prefilled
    context and reads it back, teacher-forced; an entry's score is the most attention it gets
    from any of those reading queries (any query head of its GQA group). The cache then keeps the
    top entries over every layer and head (one global ranking: the scores are probabilities,
    comparable everywhere).

    Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction" (2025).
    The scores come from a pass the scorer cannot run itself (it needs the whole model):
    ``vlm_kv.reconstruction.kvzip_prefill`` runs it and hands them over with ``load_scores``.
    Entries after the scored context (a question, generated tokens) are kept: KVzip compresses
    the context once, and what follows is the conversation that uses it.
    """

    name: ClassVar[str] = "kvzip"
    num_sinks: int = 4
    # [B, H, P] per layer: scores of positions 0 .. P-1 (the reconstructed context)
    scores_by_position: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def sinks(self) -> int:
        return self.num_sinks

    def load_scores(self, per_layer: list[torch.Tensor]) -> None:
        """Reconstruction scores of every layer, [B, H, P] each, by position."""
        self.scores_by_position = {i: s.float() for i, s in enumerate(per_layer)}

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        table = self.scores_by_position.get(ctx.layer_idx)
        if table is None:
            raise MissingReconstructionScores(
                "policy 'kvzip' scores the context by a reconstruction pass before it compresses: fill the cache "
                "with vlm_kv.reconstruction.kvzip_prefill(model, cache, input_ids), not a plain forward")
        positions = ctx.view.positions.long()  # [B, H, L], -1 where empty
        known = (positions >= 0) & (positions < table.shape[-1])
        table = table.to(positions.device)
        scores = torch.gather(table, 2, positions.clamp(0, table.shape[-1] - 1))
        return torch.where(known, scores, torch.full_like(scores, float("inf")))
