"""Eviction policies: a scorer (what to keep) paired with an allocation (how much where).

``catalog`` lists the policies one layer can run, ``registry`` adds polykv (per-layer patterns from
a strategy) and builds a policy by name; each scorer has its own module."""

from __future__ import annotations

from vlm_kv.policies.base import ScoreContext, Scorer
from vlm_kv.policies.catalog import (
    FULL_POLICY,
    PolicySpec,
    UnknownPolicyError,
    normalize_policy_name,
)
from vlm_kv.policies.h2o import H2O
from vlm_kv.policies.knorm import KNorm
from vlm_kv.policies.polykv import PolyKV, PolyKVAllocation
from vlm_kv.policies.random_scorer import RandomScorer
from vlm_kv.policies.registry import GATED_POLICIES, POLICIES, build_policy, policy_spec
from vlm_kv.policies.retention import RetentionScorer
from vlm_kv.policies.snapkv import SnapKV
from vlm_kv.policies.streaming_llm import StreamingLLM
from vlm_kv.policies.tova import TOVA
from vlm_kv.storage.allocation import GlobalTopK, HeadAdaptive, Pyramid, Uniform

__all__ = [
    "POLICIES", "GATED_POLICIES", "FULL_POLICY", "normalize_policy_name", "policy_spec", "RetentionScorer", "PolicySpec", "build_policy", "UnknownPolicyError", "Scorer", "ScoreContext",
    "H2O", "KNorm", "PolyKV", "PolyKVAllocation", "RandomScorer", "SnapKV", "StreamingLLM", "TOVA",
    "Uniform", "Pyramid", "HeadAdaptive", "GlobalTopK",
]
