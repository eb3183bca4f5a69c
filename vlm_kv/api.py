"""``make_cache``: the one call users need before ``model.generate(past_key_values=cache)``."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Mapping
from typing import Any, Union

import torch
from transformers import DynamicCache

from vlm_kv.cache.cache import CompressedCache
from vlm_kv.cache.hooks import attach
from vlm_kv.config import Budget, BudgetError, CacheOptions, TierConfig
from vlm_kv.gates import default_gates_for
from vlm_kv.gates.io import check_fits, load_gates
from vlm_kv.gates.retention_gate import RetentionGates
from vlm_kv.models.adapters import get_adapter
from vlm_kv.policies import (
    FULL_POLICY,
    POLICIES,
    build_policy,
    normalize_policy_name,
    policy_spec,
)
from vlm_kv.policies.catalog import PolicySpec
from vlm_kv.policies.polykv import strategy_kwargs
from vlm_kv.policies.strategy import Strategy
from vlm_kv.tiers.rope_keys import KeyRotation

__all__ = ["attach", "cache_kwarg", "check_cache_options", "make_cache"]


def cache_kwarg(model: torch.nn.Module) -> str:
    """Name under which ``model.generate`` / ``model(...)`` take the cache on this transformers:
    ``cache`` since 5.x renamed it, ``past_key_values`` before."""
    try:
        params = inspect.signature(type(model).prepare_inputs_for_generation).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


#: make_cache's keywords before CacheOptions and TierConfig bundled them; accepted for one
#: release with a DeprecationWarning
LEGACY_CACHE_OPTIONS = tuple(f.name for f in dataclasses.fields(CacheOptions) if f.name != "layerwise_prefill")
LEGACY_TIER_OPTIONS = ("int2_share", "window", "key_rope", "spill", "int2_value", "fp_unit", "int2_share_by_budget",
                       "key_grid", "basis")
DEFAULT_BUDGET = 0.25

Tiers = Union[str, TierConfig, Mapping[str, Any], None]


def make_cache(
    model: torch.nn.Module,
    policy: str = "snapkv",
    budget: Budget | float | int | None = None,
    *,
    tiers: Tiers = None,
    gates: "str | torch.nn.Module | None" = None,
    strategy: "str | Strategy | None" = None,
    options: CacheOptions | None = None,
    **legacy: Any,
) -> CompressedCache | DynamicCache:
    """A KV cache for ``model`` that holds ``budget`` of the full cache, chosen by ``policy``.

    budget: a float in (0, 1] is a fraction of the full cache (``1.0``: all of it); an int >= 2 is
        an average number of tokens per KV head; default 0.25 (``"full"``: 1.0, the only budget it
        takes). A bare ``1`` and floats above 1 raise BudgetError (whole cache or one token? tokens
        or a typo?); ``Budget(tokens_per_head=1)`` spells one token per head. A fraction works at
        every prompt length: the policy's protected sinks and recent window shrink to what the
        budget allows (sinks first, then the window).
    policy: one of ``vlm_kv.policies.POLICIES`` or ``"full"`` (a plain DynamicCache: it keeps every
        token, so it refuses a budget other than 1.0 and every compression option rather than
        ignore them); case and dashes do not matter ("DBTrimKV" = "dbtrimkv").
    tiers: route windows to full precision, INT2 (2-bit, still attended, promotable) or evicted,
        ranked by the policy's scores under the same byte budget (QEvict's recoverable tiers).
        ``"int2"``: the policy's own tier settings (``PolicySpec.tier_config``); a dict of
        ``TierConfig`` fields: those settings with these fields changed; a ``TierConfig``: exactly
        that; ``None``: untiered (``qevict`` and ``kivi2`` are tiered by themselves, and ``"none"``
        refuses them). The policy's scores decide what ranking means: ``streaming_llm`` ranks by
        recency (KIVI's split under a budget), ``random`` at random (the floor). ``fastv``,
        ``visionzip``, ``dbtrimkv_threshold`` and ``polykv`` refuse tiers.
    gates: for ``trimkv`` / ``dbtrimkv``: a folder saved by ``vlm-kv train-gates`` or a
        ``RetentionGates`` module; SmolLM2-135M and smollava use the gates shipped in the package by
        default (each its own).
    strategy: for ``polykv``: a strategy JSON written by ``vlm-kv calibrate`` or a ``Strategy``;
        SmolLM2-135M uses the strategy shipped in the package by default.
    options: how the cache runs (eviction interval, chunked prefill, attention backend, scorer
        settings...): see ``CacheOptions``.

    The keywords of earlier releases (``evict_every=``, ``prefill_chunk=``, ``int2_share=``, ...)
    still work for one release and warn: they are ``CacheOptions`` and ``TierConfig`` fields.
    """
    key = normalize_policy_name(policy)
    if key == FULL_POLICY:
        _check_full(budget, tiers, gates, strategy, options, legacy)
        get_adapter(model)  # same clear error for unsupported models
        return DynamicCache(config=model.config)
    options, tiers = _fold_legacy(options, tiers, legacy)
    budget = Budget.parse(DEFAULT_BUDGET if budget is None else budget)
    spec = policy_spec(key)
    gate_kind = spec.gate_kind
    if strategy is not None and not spec.needs_strategy:
        raise ValueError(f"strategy= is for policy 'polykv', not {key!r}")
    if spec.needs_strategy:
        scorer_kwargs, allocation_kwargs, gate_kind = strategy_kwargs(model, strategy, options.scorer_kwargs,
                                                                      options.allocation_kwargs)
        options = dataclasses.replace(options, scorer_kwargs=scorer_kwargs, allocation_kwargs=allocation_kwargs)
    scorer, alloc, tier_config = _plan(key, spec, budget, tiers, options)
    adapter = attach(model)
    rotation = None
    if tier_config is not None and tier_config.key_rope == "pre":
        rotation = KeyRotation.from_model(model, adapter.uses_mrope)
    gate_module = None
    if gate_kind is not None or gates is not None:
        gate_module = _resolve_gates(model, gates, gate_kind or "dbtrimkv", key)
    return CompressedCache(adapter, scorer, alloc, budget, options=options, tiers=tier_config, gates=gate_module,
                           key_rotation=rotation, policy_name=key, model_id=id(model))


def check_cache_options(policy: str = "snapkv", budget: Budget | float | int | None = None, *, tiers: Tiers = None,
                        gates: Any = None, strategy: Any = None, options: CacheOptions | None = None,
                        **legacy: Any) -> None:
    """Every check ``make_cache`` makes that needs no model: the policy name, the budget's spelling
    and range, what ``"full"`` refuses, the tier settings and which policies take them, the budget
    rule of policies that keep what their own rule says (``kivi2``, ``dbtrimkv_threshold``) and a
    token budget's room for the sinks. Command lines call it before loading a model, so a bad
    argument fails in a second instead of after the model loads. Raises what make_cache raises."""
    key = normalize_policy_name(policy)
    if key == FULL_POLICY:
        _check_full(budget, tiers, gates, strategy, options, legacy)
        return
    options, tiers = _fold_legacy(options, tiers, legacy)
    spec = policy_spec(key)
    budget = Budget.parse(DEFAULT_BUDGET if budget is None else budget)
    if strategy is not None and not spec.needs_strategy:
        raise ValueError(f"strategy= is for policy 'polykv', not {key!r}")
    if spec.needs_strategy:  # its scorer and allocation come from a strategy, read with the model
        _tier_config(key, spec, None, tiers)
        return
    _plan(key, spec, budget, tiers, options)


def tiers_with_fields(policy: str, tiers: str | None, fields: Mapping[str, Any]) -> Tiers:
    """``tiers=`` from a tier switch (``"int2"``, ``"none"`` or None) and TierConfig fields given
    beside it, as flat settings arrive from model arguments or grid cells: the fields as a dict
    when the cache is tiered (by the switch, or by the policy itself: qevict, kivi2), else the
    switch. Fields that configure a tier nobody asked for raise (``spill=False`` asks for nothing)."""
    asked = [k for k, v in fields.items() if not (k == "spill" and v is False)]
    key = normalize_policy_name(policy)
    tiered = tiers not in (None, "none") or (key in POLICIES and POLICIES[key].default_tiers is not None)
    if asked and not tiered:
        raise ValueError(f"{', '.join(f'{k}=' for k in asked)} configure the INT2 tier: pass tiers=int2 too")
    return dict(fields) if fields and tiered else tiers


def _fold_legacy(options: CacheOptions | None, tiers: Tiers, legacy: dict[str, Any],
                 stacklevel: int = 3) -> tuple[CacheOptions, Tiers]:
    """Fold the keywords of earlier releases into ``options`` and the tier overrides, with a
    DeprecationWarning; anything else is an unknown keyword."""
    unknown = sorted(set(legacy) - set(LEGACY_CACHE_OPTIONS) - set(LEGACY_TIER_OPTIONS))
    if unknown:
        known = ("tiers", "gates", "strategy", "options")
        raise TypeError(f"unknown cache option(s) {', '.join(unknown)}; make_cache takes {', '.join(known)} "
                        f"(CacheOptions: {', '.join(LEGACY_CACHE_OPTIONS)}; TierConfig: {', '.join(LEGACY_TIER_OPTIONS)})")
    if options is not None and not isinstance(options, CacheOptions):
        raise TypeError(f"options must be a CacheOptions, got {type(options).__name__}")
    if not legacy:
        return options or CacheOptions(), tiers
    warnings.warn(f"make_cache({', '.join(f'{k}=' for k in legacy)}) is deprecated: pass options=CacheOptions(...) "
                  "for the cache's run settings and tiers=\"int2\" / a dict of TierConfig fields / a TierConfig "
                  "for the tiers", DeprecationWarning, stacklevel=stacklevel)  # the warning names the caller's line
    run = {k: v for k, v in legacy.items() if k in LEGACY_CACHE_OPTIONS}
    if run:
        if options is not None:
            raise TypeError(f"pass {', '.join(f'{k}=' for k in run)} inside options=, not beside it")
        options = CacheOptions(**run)
    # a tier keyword left at None (or spill=False) asks for nothing, as before
    tier_fields = {k: v for k, v in legacy.items()
                   if k in LEGACY_TIER_OPTIONS and v is not None and not (k == "spill" and v is False)}
    if tier_fields:
        if tiers == "none":
            raise ValueError(f"{', '.join(f'{k}=' for k in tier_fields)} configure the INT2 tier: pass tiers='int2' too")
        if isinstance(tiers, TierConfig):
            raise TypeError("a TierConfig is the whole tier configuration: set its fields, not keywords beside it")
        if tiers is None:  # fine for a policy tiered by itself (qevict, kivi2); _tier_config decides
            tiers = _UntieredFields(tier_fields)
        else:
            tiers = {**({} if tiers == "int2" else dict(tiers)), **tier_fields}
    return options or CacheOptions(), tiers


class _UntieredFields(dict):
    """Tier fields given as legacy keywords with ``tiers`` left out."""


def _check_full(budget: Budget | float | int | None, tiers: Tiers, gates: Any, strategy: Any,
                options: CacheOptions | None, legacy: dict[str, Any]) -> None:
    """``"full"`` keeps every token: refuse a budget and options it would otherwise ignore."""
    if budget is not None and Budget.parse(budget) != Budget(fraction=1.0):
        raise BudgetError(
            f"policy 'full' is the uncompressed cache and keeps every token: it takes no budget (got "
            f"{Budget.parse(budget).describe()}); leave the budget out or pass 1.0"
        )
    options, _ = _fold_legacy(options, None, {k: v for k, v in legacy.items() if k in LEGACY_CACHE_OPTIONS},
                              stacklevel=4)
    ignored = [f"{f.name}=" for f in dataclasses.fields(CacheOptions)
               if getattr(options, f.name) != f.default]
    ignored += [f"{k}=" for k, v in legacy.items() if k in LEGACY_TIER_OPTIONS and v is not None and v is not False]
    ignored += [f"{name}=" for name, value in (("tiers", tiers), ("gates", gates), ("strategy", strategy))
                if value is not None and not (name == "tiers" and value == "none")]
    if ignored:
        raise ValueError(f"policy 'full' compresses nothing, so {', '.join(ignored)} would be ignored: drop "
                         f"{'it' if len(ignored) == 1 else 'them'} or choose a compressing policy")


def _plan(key: str, spec: PolicySpec, budget: Budget, tiers: Tiers,
          options: CacheOptions) -> tuple[Any, Any, TierConfig | None]:
    """(scorer, allocation, tier config) of a compressed cache, every option checked against the
    policy and the budget."""
    scorer, alloc = build_policy(key, options.allocation, options.scorer_kwargs, options.allocation_kwargs)
    tier_config = _tier_config(key, spec, alloc, tiers)
    if not alloc.bounded_by_budget and budget != Budget(fraction=1.0):
        raise BudgetError(
            f"policy {key!r} keeps what its own rule says, whatever the budget: pass budget=1.0 "
            f"(got {budget.describe()}); its memory follows the content"
        )
    if budget.tokens_per_head is not None and budget.tokens_per_head - options.slack < scorer.sinks:
        raise BudgetError(
            f"budget too small: {budget.tokens_per_head} tokens per KV head (minus slack {options.slack}) cannot "
            f"hold the {scorer.sinks} attention sinks policy {key!r} always keeps; raise the budget"
        )
    return scorer, alloc, tier_config


def _tier_config(key: str, spec: PolicySpec, alloc: Any, tiers: Tiers) -> TierConfig | None:
    """The tiering a cache gets from ``tiers=`` and the policy (qevict and kivi2 are tiered)."""
    if isinstance(tiers, str) and tiers not in ("int2", "none"):
        raise ValueError(f"tiers must be 'int2' (or 'none'), a dict of TierConfig fields or a TierConfig, got {tiers!r}")
    if tiers is not None and not isinstance(tiers, (str, TierConfig, Mapping)):
        raise TypeError(f"tiers must be 'int2', a dict of TierConfig fields or a TierConfig, got {type(tiers).__name__}")
    if isinstance(tiers, _UntieredFields) and spec.default_tiers is None:
        raise ValueError(f"{', '.join(f'{k}=' for k in tiers)} configure the INT2 tier: pass tiers='int2' too")
    if tiers is None and spec.default_tiers is not None:
        tiers = "int2"
    if tiers in (None, "none"):
        if spec.default_tiers is not None:
            raise ValueError(f"policy {key!r} is a tiered cache: it cannot run with tiers='none'")
        return None
    if not spec.tierable:
        usable = ", ".join(name for name, s in POLICIES.items() if s.tierable and s.default_tiers is None)
        raise ValueError(
            f"policy {key!r} cannot route windows to tiers (its scores do not rank windows under a byte "
            f"budget); tiers work with {usable}"
        )
    if getattr(alloc, "modality_floor", None) or getattr(alloc, "modality_cap", None) or getattr(alloc, "min_per_head", 0):
        raise ValueError("modality floors/caps and min_per_head of the global allocation are not applied by the tier "
                         "router; drop them or tiers")
    if isinstance(tiers, TierConfig):
        spec.check_tier_config(tiers)
        return tiers
    return spec.tier_config({} if tiers == "int2" else tiers)


def _resolve_gates(model: torch.nn.Module, gates: "str | torch.nn.Module | None", kind: str, policy: str) -> torch.nn.Module:
    fingerprint = get_adapter(model).fingerprint()
    if gates is None:
        gates = default_gates_for(fingerprint, kind=kind)
        if gates is None:
            raise ValueError(
                f"policy {policy!r} needs retention gates for this model: pass gates=DIR "
                "(train them with `vlm-kv train-gates`)"
            )
    if isinstance(gates, str):
        module = load_gates(gates, fingerprint=fingerprint)
    elif isinstance(gates, RetentionGates):
        check_fits(gates.config, fingerprint)
        module = gates
    else:
        raise TypeError(f"gates must be a folder or a RetentionGates module, got {type(gates).__name__}")
    param = next(model.parameters())
    return module.to(param.device).eval()
