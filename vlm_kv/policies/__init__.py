"""Eviction policies: a scorer (what to keep) paired with an allocation (how much where)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from vlm_kv.allocation import ALLOCATIONS, Allocation, GlobalTopK, HeadAdaptive, Pyramid, Uniform
from vlm_kv.policies.base import ScoreContext, Scorer
from vlm_kv.policies.h2o import H2O
from vlm_kv.policies.knorm import KNorm
from vlm_kv.policies.polykv import PolyKV, PolyKVAllocation
from vlm_kv.policies.random_scorer import RandomScorer
from vlm_kv.policies.retention import RetentionScorer
from vlm_kv.policies.snapkv import SnapKV
from vlm_kv.policies.streaming_llm import StreamingLLM
from vlm_kv.policies.fastv import FastV
from vlm_kv.policies.rkv import RKV
from vlm_kv.policies.threshold import RetentionThreshold
from vlm_kv.policies.visionzip import VisionZip
from vlm_kv.policies.tova import TOVA
from vlm_kv.policies.kivi import KIVI2Scorer, QuantizeEverything
from vlm_kv.policies.qevict import QEvictScorer


@dataclass(frozen=True)
class PolicySpec:
    """Everything the library needs to know about a policy, in one place.

    ``gate_kind``: the kind of retention gates the policy scores with (None: no gates). Sinks
    and the protected recent window are properties of the scorer (``Scorer.sinks``,
    ``Scorer.protected_window``).
    """

    scorer: Callable[..., Scorer]
    allocation: Callable[..., Allocation]
    description: str
    gate_kind: str | None = None
    needs_strategy: bool = False  # built from a calibrated per-layer strategy (make_cache(strategy=))
    visual_only: bool = False     # evicts image/video entries only; text always stays
    tierable: bool = True         # its scores can rank windows for the FP / INT2 / evicted tiers
    default_tiers: dict | None = None  # the policy IS a tiered cache: TierConfig fields it uses
    tier_settings: dict | None = None  # TierConfig fields it gets with tiers="int2" (measured, docs/tiers.md)

    @property
    def needs_gates(self) -> bool:
        return self.gate_kind is not None


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
    "fastv": PolicySpec(FastV, Uniform, "visual tokens ranked by the last token's attention from layer K on; text kept",
                        visual_only=True, tierable=False),
    "visionzip": PolicySpec(VisionZip, Uniform, "dominant visual tokens + one per contextual group; text kept",
                            visual_only=True, tierable=False),
    "trimkv": PolicySpec(RetentionScorer, Uniform, "learned retention gates, top-M per head", gate_kind="trimkv"),
    # tiered: FP per entry, INT2 share 0.5 at budgets up to 0.1 and 0.3 from 0.25 (session 7,
    # docs/tiers.md: lower KL than QEvict's whole windows with q 0.7 on pg84 and on the training
    # text at 0.05 / 0.1 / 0.25; q 0.5 best at 0.05, q 0.3 at 0.25 on both texts)
    "dbtrimkv": PolicySpec(RetentionScorer, GlobalTopK, "coupled retention gates, one global top-k over all layers and heads",
                           gate_kind="dbtrimkv",
                           tier_settings={"fp_unit": "token", "int2_share_by_budget": (0.1, 0.5, 0.25, 0.3)}),
    "dbtrimkv_threshold": PolicySpec(RetentionScorer, RetentionThreshold,
                                     "coupled retention gates, keep while score >= log alpha (no fixed budget)",
                                     gate_kind="dbtrimkv", tierable=False),
    "polykv": PolicySpec(PolyKV, PolyKVAllocation, "per-layer, per-phase patterns and budget shares from a calibrated strategy",
                         needs_strategy=True, tierable=False),
    "qevict": PolicySpec(QEvictScorer, Uniform, "H2O window mass routing windows to FP / INT2 / evicted (QEvict)",
                         # the paper's recipe is key_grid="fp16", int2_share=0.7, basis="channel"; with the compact
                         # grid a larger INT2 share wins on four pg84 passages at 0.05 and 0.1 (docs/tiers.md, session 8)
                         default_tiers={"int2_share": 0.9}),
    "kivi2": PolicySpec(KIVI2Scorer, QuantizeEverything,
                        "everything but sinks and a recent residual in INT2, nothing evicted (KIVI-2)",
                        default_tiers={"quantize_all": True, "window": 32, "key_grid": "fp16",
                                       "basis": "channel"}),  # KIVI's fp16 grid, channel basis
}

FULL_POLICY = "full"

GATED_POLICIES = tuple(name for name, spec in POLICIES.items() if spec.needs_gates)


class UnknownPolicyError(ValueError):
    pass


def normalize_policy_name(name: str) -> str:
    """The registry key for a user-given policy name: "DBTrimKV" -> "dbtrimkv", "Streaming-LLM" -> "streaming_llm"."""
    if not isinstance(name, str):
        raise UnknownPolicyError(f"policy must be a name, got {type(name).__name__}")
    key = name.strip().lower().replace("-", "_")
    if key != FULL_POLICY and key not in POLICIES:
        raise UnknownPolicyError(f"unknown policy {name!r}; known: {', '.join([FULL_POLICY, *POLICIES])}")
    return key


def policy_spec(name: str) -> PolicySpec:
    key = normalize_policy_name(name)
    if key == FULL_POLICY:
        raise UnknownPolicyError("policy 'full' is the uncompressed DynamicCache; it has no scorer")
    return POLICIES[key]


def build_policy(
    name: str,
    allocation: str | None = None,
    scorer_kwargs: dict[str, Any] | None = None,
    allocation_kwargs: dict[str, Any] | None = None,
) -> tuple[Scorer, Allocation]:
    """Scorer and allocation for a policy name; ``allocation`` overrides the policy's own."""
    spec = policy_spec(name)
    scorer = spec.scorer(**(scorer_kwargs or {}))
    if allocation is None:
        alloc = spec.allocation(**(allocation_kwargs or {}))
    else:
        if allocation not in ALLOCATIONS:
            raise UnknownPolicyError(f"unknown allocation {allocation!r}; known: {', '.join(ALLOCATIONS)}")
        alloc = ALLOCATIONS[allocation](**(allocation_kwargs or {}))
    return scorer, alloc


__all__ = [
    "POLICIES", "GATED_POLICIES", "FULL_POLICY", "normalize_policy_name", "policy_spec", "RetentionScorer", "PolicySpec", "build_policy", "UnknownPolicyError", "Scorer", "ScoreContext",
    "H2O", "KNorm", "PolyKV", "PolyKVAllocation", "RandomScorer", "SnapKV", "StreamingLLM", "TOVA",
    "Uniform", "Pyramid", "HeadAdaptive", "GlobalTopK",
]
