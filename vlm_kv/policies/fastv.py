from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from vlm_kv.models.adapters import TEXT
from vlm_kv.policies.base import ScoreContext, Scorer


class OncePerEntry:
    """Which visual entries a layer has already judged (positions below ``upto``).

    Visual-token pruning decides once per image, when its tokens first meet an eviction step;
    later eviction steps must not prune the survivors again. Kept in the scorer (one scorer
    per cache), keyed by layer."""

    def __init__(self) -> None:
        self.upto: dict[int, int] = {}

    def new_entries(self, ctx: ScoreContext) -> torch.Tensor:
        upto = self.upto.get(ctx.layer_idx, 0)
        if ctx.seen < upto:  # the cache was reset and refilled
            upto = 0
        self.upto[ctx.layer_idx] = ctx.seen
        return ctx.view.valid & (ctx.view.positions >= upto)


def visual_mask(ctx: ScoreContext) -> torch.Tensor:
    return ctx.view.valid & (ctx.view.modality != TEXT)


def check_text_fits(ctx: ScoreContext, policy: str) -> None:
    """Fail closed: these policies never evict text, so the budget must hold all of it."""
    text = (ctx.view.valid & (ctx.view.modality == TEXT)).sum(-1).max(-1).values  # [B]
    if bool((text > ctx.capacity.to(text.device)).any()):
        raise ValueError(
            f"{policy} never evicts text tokens, but the budget gives {ctx.capacity.tolist()} entries per head for "
            f"{text.tolist()} text tokens; raise the budget (budget=1.0 applies only the {policy} rule)"
        )


def head_attention(ctx: ScoreContext) -> torch.Tensor:
    """Attention of the remembered queries, averaged over them and over all heads of the layer
    when every head holds the same positions (else over each KV head's group): [B, H, L]."""
    attn = ctx.window_attention().mean(dim=2) / ctx.window_queries.shape[2]
    pos = ctx.view.positions
    if attn.shape[1] > 1 and bool((pos == pos[:, :1]).all()):
        attn = attn.mean(dim=1, keepdim=True).expand_as(attn)
    return attn.masked_fill(~ctx.view.valid, 0.0)


@dataclass
class FastV(Scorer):
    """Visual tokens ranked by the attention the last token gives them, from layer ``layer`` on.

    Layers below ``layer`` (K) keep every entry. From layer K on, each image's tokens are
    judged once, at the first eviction step that sees them: the ``drop_ratio`` (R) share with
    the least attention from the most recent query (averaged over heads) is dropped. Text
    tokens are never evicted. Kept visual tokens score their attention, so a budget below
    1.0 trims them further in that order (text still first; a budget that cannot hold the
    text raises).

    Chen et al., "An Image is Worth 1/2 Tokens After Layer 2: Plug-and-Play Inference
    Acceleration for Large Vision-Language Models" (ECCV 2024), K = 2, R = 50%. FastV drops
    the tokens from the hidden states of later layers; in a cache the same tokens leave the
    KV cache of layers >= K, and each layer ranks with its own attention (FastV ranks once,
    at layer K).
    """

    name: ClassVar[str] = "fastv"
    layer: int = 2
    drop_ratio: float = 0.5
    _judged: OncePerEntry = field(default_factory=OncePerEntry, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.drop_ratio < 1:
            raise ValueError(f"drop_ratio must be in [0, 1), got {self.drop_ratio}")
        if self.layer < 0:
            raise ValueError(f"layer must be >= 0, got {self.layer}")

    @property
    def query_window(self) -> int:
        return 1

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        check_text_fits(ctx, "fastv")
        new = self._judged.new_entries(ctx)
        visual = visual_mask(ctx)
        scores = torch.full(ctx.view.positions.shape, float("inf"), device=ctx.view.positions.device)
        if ctx.layer_idx < self.layer:
            return scores
        attn = head_attention(ctx)
        scores = torch.where(visual, attn, scores)
        judge = visual & new
        b, h, _ = scores.shape
        for bi in range(b):
            for hi in range(h):
                idx = torch.nonzero(judge[bi, hi]).flatten()
                n_drop = math.floor(self.drop_ratio * idx.numel())
                if n_drop:
                    order = torch.argsort(attn[bi, hi, idx], stable=True)
                    scores[bi, hi, idx[order[:n_drop]]] = float("-inf")
        return scores
