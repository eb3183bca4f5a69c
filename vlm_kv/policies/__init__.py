"""Eviction policies: a scorer (what to keep) paired with an allocation (how much where)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from vlm_kv.allocation import ALLOCATIONS, Allocation, GlobalTopK, HeadAdaptive, Pyramid, Uniform
from vlm_kv.policies.base import ScoreContext, Scorer
from vlm_kv.policies.h2o import H2O
from vlm_kv.policies.knorm import KNorm
from vlm_kv.policies.random_scorer import RandomScorer
from vlm_kv.policies.retention import RetentionScorer
from vlm_kv.policies.snapkv import SnapKV
from vlm_kv.policies.streaming_llm import StreamingLLM
from vlm_kv.policies.fastv import FastV
from vlm_kv.policies.rkv import RKV
from vlm_kv.policies.threshold import RetentionThreshold
from vlm_kv.policies.visionzip import VisionZip
from vlm_kv.policies.tova import TOVA


@dataclass(frozen=True)
class PolicySpec:
    scorer: Callable[..., Scorer]
    allocation: Callable[..., Allocation]
    description: str


POLICIES: dict[str, PolicySpec] = {
    "streaming_llm": PolicySpec(StreamingLLM, Uniform, "attention sinks + most recent tokens"),
    "h2o": PolicySpec(H2O, Uniform, "accumulated attention (heavy hitters) + recent window"),
    "tova": PolicySpec(TOVA, Uniform, "attention of the current query, head-averaged"),
    "snapkv": PolicySpec(SnapKV, Uniform, "observation-window attention, pooled"),
    "pyramidkv": PolicySpec(SnapKV, Pyramid, "SnapKV scores, capacities shrinking with depth"),
    "adakv": PolicySpec(SnapKV, HeadAdaptive, "SnapKV scores, heads of a layer share its budget"),
    "knorm": PolicySpec(KNorm, Uniform, "smallest key norms"),
    "random": PolicySpec(RandomScorer, Uniform, "random entries (a floor)"),
    "rkv": PolicySpec(RKV, Uniform, "recent-query attention importance minus key-similarity redundancy (R-KV)"),
    "fastv": PolicySpec(FastV, Uniform, "visual tokens ranked by the last token's attention from layer K on; text kept"),
    "visionzip": PolicySpec(VisionZip, Uniform, "dominant visual tokens + one per contextual group; text kept"),
    "trimkv": PolicySpec(RetentionScorer, Uniform, "learned retention gates, top-M per head"),
    "dbtrimkv": PolicySpec(RetentionScorer, GlobalTopK, "coupled retention gates, one global top-k over all layers and heads"),
    "dbtrimkv_threshold": PolicySpec(RetentionScorer, RetentionThreshold,
                                     "coupled retention gates, keep while score >= log alpha (no fixed budget)"),
}

GATED_POLICIES = ("trimkv", "dbtrimkv")

FULL_POLICY = "full"


class UnknownPolicyError(ValueError):
    pass


def build_policy(
    name: str,
    allocation: str | None = None,
    scorer_kwargs: dict[str, Any] | None = None,
    allocation_kwargs: dict[str, Any] | None = None,
) -> tuple[Scorer, Allocation]:
    """Scorer and allocation for a policy name; ``allocation`` overrides the policy's own."""
    key = name.lower().replace("-", "_")
    if key not in POLICIES:
        raise UnknownPolicyError(
            f"unknown policy {name!r}; known: {', '.join([FULL_POLICY, *POLICIES])}"
        )
    spec = POLICIES[key]
    scorer = spec.scorer(**(scorer_kwargs or {}))
    if allocation is None:
        alloc = spec.allocation(**(allocation_kwargs or {}))
    else:
        if allocation not in ALLOCATIONS:
            raise UnknownPolicyError(f"unknown allocation {allocation!r}; known: {', '.join(ALLOCATIONS)}")
        alloc = ALLOCATIONS[allocation](**(allocation_kwargs or {}))
    return scorer, alloc


__all__ = [
    "POLICIES", "GATED_POLICIES", "FULL_POLICY", "RetentionScorer", "PolicySpec", "build_policy", "UnknownPolicyError", "Scorer", "ScoreContext",
    "H2O", "KNorm", "RandomScorer", "SnapKV", "StreamingLLM", "TOVA",
    "Uniform", "Pyramid", "HeadAdaptive", "GlobalTopK",
]
