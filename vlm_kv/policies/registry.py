"""Every policy by name: the layer policies of the catalog plus polykv, and how to build one."""

from __future__ import annotations

import inspect
from typing import Any

from vlm_kv.policies.base import Scorer
from vlm_kv.policies.catalog import (COMBINED_POLICY, FULL_POLICY, LAYER_POLICIES, POLICY_NAMES, PolicySpec,
                                     UnknownPolicyError, normalize_policy_name)
from vlm_kv.policies.polykv import PolyKV, PolyKVAllocation
from vlm_kv.storage.allocation import ALLOCATIONS, Allocation

_COMBINED = {COMBINED_POLICY: PolicySpec(PolyKV, PolyKVAllocation, "per-layer, per-phase patterns and budget shares from a calibrated strategy",
                         needs_strategy=True, tierable=False)}
POLICIES: dict[str, PolicySpec] = {name: LAYER_POLICIES.get(name) or _COMBINED[name] for name in POLICY_NAMES}

GATED_POLICIES = tuple(name for name, spec in POLICIES.items() if spec.needs_gates)


def policy_spec(name: str) -> PolicySpec:
    key = normalize_policy_name(name)
    if key == FULL_POLICY:
        raise UnknownPolicyError("policy 'full' is the uncompressed DynamicCache; it has no scorer")
    return POLICIES[key]


def _build(cls: type, kwargs: dict[str, Any] | None, what: str) -> Any:
    """``cls(**kwargs)``, refusing by name the fields ``cls`` does not have (a typo would otherwise
    surface as a TypeError from deep inside the cache's construction)."""
    kwargs = kwargs or {}
    known = [n for n in inspect.signature(cls).parameters if n not in ("self", "args", "kwargs")]
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        raise ValueError(f"{what} has no field {', '.join(map(repr, unknown))}; "
                         f"its fields: {', '.join(known) or 'none'}")
    return cls(**kwargs)


def build_policy(
    name: str,
    allocation: str | None = None,
    scorer_kwargs: dict[str, Any] | None = None,
    allocation_kwargs: dict[str, Any] | None = None,
) -> tuple[Scorer, Allocation]:
    """Scorer and allocation for a policy name; ``allocation`` overrides the policy's own."""
    spec = policy_spec(name)
    scorer = _build(spec.scorer, scorer_kwargs, f"policy {normalize_policy_name(name)!r}: scorer {spec.scorer.__name__}")
    if allocation is None:
        alloc = _build(spec.allocation, allocation_kwargs, f"policy {normalize_policy_name(name)!r}: allocation {spec.allocation.__name__}")
    else:
        if allocation not in ALLOCATIONS:
            raise UnknownPolicyError(f"unknown allocation {allocation!r}; known: {', '.join(ALLOCATIONS)}")
        alloc = _build(ALLOCATIONS[allocation], allocation_kwargs, f"allocation {allocation!r} ({ALLOCATIONS[allocation].__name__})")
    return scorer, alloc
