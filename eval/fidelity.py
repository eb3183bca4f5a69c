"""How far a compressed cache moves a real model's next-token distributions from the full cache.

Prefill ``context`` tokens of a text with the policy, feed the next ``continuation`` tokens one
at a time, and compare each next-token distribution with the full cache's: mean KL(full ||
compressed), top-1 agreement, and the NLL of the true next tokens. Long continuations: KL per
block of ``KL_BLOCK`` fed tokens (``kl_per_block``), and for tiered caches the moves between tiers
(``tier_moves``: demotions, promotions... from ``stats()["per_tier"]``), so one run says how KL
evolves and how many windows come back.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from vlm_kv.api import make_cache
from vlm_kv.cache.report import cache_bytes, peak_after_eviction
from vlm_kv.eval.teacher_forcing import feed_continuation


KL_BLOCK = 128  # fed tokens per entry of ``kl_per_block``


def _tier_moves(cache) -> dict[str, int] | None:
    if not getattr(cache, "tiers", None):
        return None
    moves = cache.stats()["per_tier"]
    return {k: int(moves[k]) for k in ("quantized", "demotions", "promotions", "lossless_promotions",
                                       "evicted_windows", "ledger_reuses")}


@dataclass
class FidelityResult:
    policy: str
    budget: float
    context: int
    continuation: int
    kl: float
    top1: float
    nll: float
    kv_bytes: int
    full_kv_bytes: int
    max_kv_bytes: int
    full_nll: float = float("nan")
    decode_ms_per_token: float = float("nan")
    held_bytes: int = 0  # everything the cache keeps at the end (kv_bytes()["held"]): keys/values and bookkeeping
    kl_per_block: list[float] = field(default_factory=list)  # mean KL of each KL_BLOCK fed tokens, in order
    tier_moves: dict[str, int] | None = None  # tiered caches: stats()["per_tier"] counters at the end

    def as_dict(self) -> dict:
        return asdict(self)

    def json_fields(self) -> dict:
        keys = ("policy", "budget", "context", "continuation", "kl", "top1", "nll", "kv_bytes", "full_kv_bytes", "max_kv_bytes",
                "held_bytes", "kl_per_block", "tier_moves")
        return {k: getattr(self, k) for k in keys}


def text_span(path: str, offset: int, count: int) -> str:
    """The text ``count`` tokens starting at character ``offset`` are read from (a generous slice:
    whole novels take seconds to tokenize). Checks, without a tokenizer, what can be checked before a
    model loads: the file has text at ``offset`` and at least ``count`` characters from there (no
    token is shorter than a character)."""
    if offset < 0:
        raise ValueError(f"--offset must be >= 0 characters, got {offset}")
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    if not text:
        raise ValueError(f"text file {path} is empty")
    if offset >= len(text):
        raise ValueError(f"--offset {offset} is past the end of {path} ({len(text)} characters)")
    if len(text) - offset < count:
        raise ValueError(f"{path} from offset {offset} has {len(text) - offset} characters, fewer than the {count} "
                         f"tokens needed")
    return text[offset : offset + count * 12]


def text_tokens(tokenizer, path: str, offset: int, count: int) -> torch.Tensor:
    """``count`` token ids of the text file starting at character ``offset``; [1, count]."""
    chunk = text_span(path, offset, count)
    ids = tokenizer(chunk, return_tensors="pt", add_special_tokens=False).input_ids
    if ids.shape[1] < count:
        raise ValueError(f"{path} from offset {offset} has only {ids.shape[1]} tokens, {count} needed")
    return ids[:, :count]


@torch.no_grad()
def run_reference(model, ids: torch.Tensor, context: int, progress: bool = False) -> tuple[torch.Tensor, int]:
    """Full-cache log-probs for each fed token ([M, V]) and the full cache's bytes at the end."""
    cache = DynamicCache(config=model.config)
    return feed_continuation(model, cache, ids, context, progress=progress, label="full cache").logps, cache_bytes(cache)


@torch.no_grad()
def measure(
    model,
    ids: torch.Tensor,
    context: int,
    policy: str,
    budget: float,
    reference: tuple[torch.Tensor, int],
    progress: bool = False,
    cache_factory: Callable | None = None,
    **cache_kwargs,
) -> FidelityResult:
    """Compare one policy at one budget with a precomputed full-cache reference."""
    ref_logps, full_bytes = reference
    cache = cache_factory() if cache_factory else make_cache(model, policy=policy, budget=budget, **cache_kwargs)
    fed = feed_continuation(model, cache, ids, context, progress=progress, label=f"{policy} @ {budget}")
    logps, ms = fed.logps, fed.ms_per_token
    targets = ids[0, context + 1 :]
    kl = F.kl_div(logps, ref_logps, log_target=True, reduction="none").sum(-1)
    top1 = (logps.argmax(-1) == ref_logps.argmax(-1)).float()
    nll = -logps.gather(1, targets[:, None]).squeeze(1)
    full_nll = -ref_logps.gather(1, targets[:, None]).squeeze(1)
    kv = cache_bytes(cache)
    peak = peak_after_eviction(cache)
    held = int(cache.kv_bytes()["held"]) if hasattr(cache, "kv_bytes") else kv
    return FidelityResult(
        policy=policy,
        budget=budget,
        context=context,
        continuation=int(targets.numel()),
        kl=float(kl.mean()),
        top1=float(top1.mean()),
        nll=float(nll.mean()),
        kv_bytes=int(kv),
        full_kv_bytes=int(full_bytes),
        max_kv_bytes=int(peak),
        held_bytes=held,
        full_nll=float(full_nll.mean()),
        decode_ms_per_token=ms,
        kl_per_block=[float(block.mean()) for block in kl.split(KL_BLOCK)],
        tier_moves=_tier_moves(cache),
    )


def fidelity(
    model,
    tokenizer,
    text_path: str,
    context: int,
    continuation: int,
    runs: list[tuple[str, float]],
    offset: int = 0,
    progress: bool = False,
    **cache_kwargs,
) -> list[FidelityResult]:
    """Measure several (policy, budget) pairs against one shared full-cache reference."""
    ids = text_tokens(tokenizer, text_path, offset, context + continuation + 1)
    reference = run_reference(model, ids, context, progress)
    return [measure(model, ids, context, p, b, reference, progress, **cache_kwargs) for p, b in runs]
