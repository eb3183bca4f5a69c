from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vlm_kv.policies.base import ScoreContext, Scorer


@dataclass
class RKV(Scorer):
    """Redundancy-aware scoring for long reasoning outputs:
    ``score = mix_lambda * importance - (1 - mix_lambda) * redundancy``.

    importance: attention of the last ``window`` queries on each entry, averaged over the
    window and over the query heads of a GQA group, then max-pooled along the entries
    (kernel ``kernel``). redundancy: mean cosine similarity of an entry's key to the other
    candidate keys of its head, softmax-normalised over the entries; for every key, its
    most recent partner above ``similarity_threshold`` does not count (so of a run of
    near-duplicates the latest copy looks least redundant and survives). The window's own
    queries' tokens are always kept and are not candidates.

    Cai et al., "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models" (2025);
    defaults (window 8, kernel 7, lambda 0.07, threshold 0.5) follow the public
    implementations. The authors compress every 128 decode steps; here the cache's
    ``evict_every`` sets the cadence.
    """

    name: ClassVar[str] = "rkv"
    window: int = 8
    kernel: int = 7
    mix_lambda: float = 0.07
    similarity_threshold: float = 0.5

    def __post_init__(self) -> None:
        if not 0 <= self.mix_lambda <= 1:
            raise ValueError(f"mix_lambda must be in [0, 1], got {self.mix_lambda}")
        if self.window < 1 or self.kernel < 1:
            raise ValueError("window and kernel must be >= 1")

    @property
    def query_window(self) -> int:
        return self.window

    def protected_window(self, capacity: int) -> int:
        return self.window

    def importance(self, ctx: ScoreContext) -> torch.Tensor:
        n_queries = ctx.window_queries.shape[2]
        attn = ctx.window_attention().mean(dim=2) / n_queries  # [B, H, L]
        attn = attn.masked_fill(~ctx.view.valid, 0.0)
        if self.kernel <= 1:
            return attn
        b, h, length = attn.shape
        pooled = torch.nn.functional.max_pool1d(attn.reshape(b * h, 1, length), self.kernel, stride=1,
                                                padding=self.kernel // 2)
        return pooled[..., :length].reshape(b, h, length)

    def redundancy(self, ctx: ScoreContext) -> torch.Tensor:
        view = ctx.view
        candidates = view.valid & (view.positions < ctx.seen - self.window)  # [B, H, L]
        keys = torch.nn.functional.normalize(view.keys.float(), dim=-1)
        sim = torch.matmul(keys, keys.transpose(-1, -2))  # [B, H, L, L]
        pair = candidates[..., :, None] & candidates[..., None, :]
        eye = torch.eye(view.length, dtype=torch.bool, device=sim.device)
        sim = sim.masked_fill(~pair | eye, 0.0)
        # each row's most recent similar partner is not held against that partner
        similar = sim > self.similarity_threshold
        pos = view.positions[..., None, :].expand_as(sim)
        latest = torch.where(similar, pos, torch.full_like(pos, -1)).argmax(dim=-1, keepdim=True)  # [B, H, L, 1]
        has = similar.any(dim=-1, keepdim=True)
        sim = sim.masked_fill(torch.zeros_like(similar).scatter(-1, latest, has), 0.0)
        count = candidates.sum(-1, keepdim=True).clamp(min=1).float()  # [B, H, 1]
        mean_sim = sim.sum(dim=-2) / count  # [B, H, L]: how much each key resembles the others
        mean_sim = mean_sim.masked_fill(~candidates, float("-inf"))
        red = torch.softmax(mean_sim, dim=-1)
        return torch.nan_to_num(red, nan=0.0)

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        return self.mix_lambda * self.importance(ctx) - (1 - self.mix_lambda) * self.redundancy(ctx)
