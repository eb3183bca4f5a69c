from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from vlm_kv.policies.base import ScoreContext, Scorer
from vlm_kv.policies.fastv import OncePerEntry, check_text_fits, head_attention, visual_mask


@dataclass
class VisionZip(Scorer):
    """VisionZip-style visual token selection: dominant tokens plus contextual representatives.

    Each image's tokens are judged once, at the first eviction step that sees them, in every
    layer. Dominant: the ``dominant_ratio`` share with the most attention from the last
    ``window`` queries (averaged over them and over heads). Contextual: the rest are grouped
    around ``contextual_ratio`` of them, evenly spaced, by key cosine similarity (each token
    joins its most similar target). Text tokens are never evicted.

    Yang et al., "VisionZip: Longer is Better but Not Necessary in Vision Language Models"
    (CVPR 2025); 54 dominant + 10 contextual of LLaVA-1.5's 576 tokens by default. Two
    departures, both forced by where this runs:
    * dominance comes from the language model's attention to the image (the text after it),
      not from the vision encoder's [CLS] attention, which the KV cache never sees;
    * VisionZip *merges* each contextual group into one token (the mean of its members). This
      cache only keeps or evicts stored entries, so each group is represented by the member
      whose key is closest to the group's mean key: a kept real token instead of a synthetic
      average. Memory is the same (one entry per group); the content is one member's, not the
      average.
    """

    name: ClassVar[str] = "visionzip"
    dominant_ratio: float = 54 / 576
    contextual_ratio: float = 10 / 576
    window: int = 32
    _judged: OncePerEntry = field(default_factory=OncePerEntry, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not (0 < self.dominant_ratio and 0 <= self.contextual_ratio and self.dominant_ratio + self.contextual_ratio <= 1):
            raise ValueError("need 0 < dominant_ratio, 0 <= contextual_ratio, dominant_ratio + contextual_ratio <= 1")

    @property
    def query_window(self) -> int:
        return self.window

    def select(self, attn: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For one head's new visual entries (attn [n], keys [n, D]): indices of the dominant
        tokens and of the contextual representatives."""
        n = attn.numel()
        n_dom = min(n, max(1, round(self.dominant_ratio * n)))
        dominant = torch.argsort(attn, descending=True, stable=True)[:n_dom]
        rest = torch.ones(n, dtype=torch.bool)
        rest[dominant] = False
        rest = torch.nonzero(rest).flatten()
        n_ctx = min(rest.numel(), round(self.contextual_ratio * n))
        if n_ctx == 0:
            return dominant, rest[:0]
        targets = rest[torch.linspace(0, rest.numel() - 1, n_ctx).round().long()]
        unit = torch.nn.functional.normalize(keys.float(), dim=-1)
        group = (unit[rest] @ unit[targets].T).argmax(dim=-1)  # [len(rest)] -> target slot
        group[torch.searchsorted(rest, targets)] = torch.arange(n_ctx)  # a target is its own group
        reps = []
        for g in range(n_ctx):
            members = rest[group == g]
            centre = torch.nn.functional.normalize(unit[members].mean(0), dim=0)
            reps.append(members[(unit[members] @ centre).argmax()])
        return dominant, torch.stack(reps)

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        check_text_fits(ctx, "visionzip")
        new = self._judged.new_entries(ctx)
        visual = visual_mask(ctx)
        attn = head_attention(ctx)
        scores = torch.where(visual, attn, torch.full_like(attn, float("inf")))
        judge = visual & new
        b, h, _ = scores.shape
        for bi in range(b):
            for hi in range(h):
                idx = torch.nonzero(judge[bi, hi]).flatten()
                if idx.numel() == 0:
                    continue
                dominant, reps = self.select(attn[bi, hi, idx].cpu(), ctx.view.keys[bi, hi, idx].cpu())
                keep = torch.zeros(idx.numel(), dtype=torch.bool)
                keep[dominant] = True
                keep[reps] = True
                scores[bi, hi, idx[~keep.to(idx.device)]] = float("-inf")
        return scores
