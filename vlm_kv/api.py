"""``make_cache``: the one call users need before ``model.generate(past_key_values=cache)``."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import DynamicCache

from vlm_kv.budget import Budget, BudgetError
from vlm_kv.cache import CompressedCache
from vlm_kv.gates import default_gates_for
from vlm_kv.gates.io import check_fits, load_gates
from vlm_kv.gates.retention_gate import RetentionGates
from vlm_kv.hooks import attach
from vlm_kv.models.adapters import get_adapter
from vlm_kv.policies import FULL_POLICY, POLICIES, build_policy, normalize_policy_name, policy_spec
from vlm_kv.strategy import Strategy
from vlm_kv.tier_router import TierConfig

__all__ = ["attach", "cache_kwarg", "check_cache_options", "make_cache"]


def cache_kwarg(model: torch.nn.Module) -> str:
    """Name under which ``model.generate`` / ``model(...)`` take the cache on this transformers:
    ``cache`` since 5.x renamed it, ``past_key_values`` before."""
    try:
        params = inspect.signature(type(model).prepare_inputs_for_generation).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def make_cache(
    model: torch.nn.Module,
    policy: str = "snapkv",
    budget: Budget | float | int | None = None,
    *,
    allocation: str | None = None,
    evict_every: int | None = None,
    slack: int = 0,
    seed: int = 0,
    scorer_kwargs: dict[str, Any] | None = None,
    allocation_kwargs: dict[str, Any] | None = None,
    gates: "str | torch.nn.Module | None" = None,
    prefill_chunk: int | None = None,
    attention_backend: str = "auto",
    strategy: "str | Strategy | None" = None,
    tiers: str | None = None,
    int2_share: float | None = None,
    window: int | None = None,
    key_rope: str | None = None,
    spill: bool | None = None,
    int2_value: float | None = None,
    fp_unit: str | None = None,
    int2_share_by_budget: tuple[float, float, float, float] | None = None,
    key_grid: str | None = None,
    basis: str | None = None,
) -> CompressedCache | DynamicCache:
    """A KV cache for ``model`` that holds ``budget`` of the full cache, chosen by ``policy``.

    budget: a float in (0, 1] is a fraction of the full cache (``1.0``: all of it); an int >= 2 is
        an average number of tokens per KV head; default 0.25 (``"full"``: 1.0, the only budget it takes). A bare ``1`` and floats above 1 raise BudgetError
        (whole cache or one token? tokens or a typo?); ``Budget(tokens_per_head=1)`` spells one token
        per head. A fraction works at every prompt length: the policy's protected sinks and recent
        window shrink to what the budget allows (sinks first, then the window).
    policy: one of ``vlm_kv.policies.POLICIES`` or ``"full"`` (a plain DynamicCache: it keeps every
        token, so it refuses a budget other than 1.0 and every compression option below rather than
        ignore them); case and dashes do not matter ("DBTrimKV" = "dbtrimkv").
    allocation: override how the budget is spread: uniform, pyramid, adaptive, global.
    evict_every: decode steps between eviction steps (one always follows each prefill); default
        16, or ``window`` for a tiered cache (QEvict routes every w steps).
    slack: tokens per head kept free below the budget at each step.
    gates: for ``trimkv`` / ``dbtrimkv``: a folder saved by ``vlm-kv train-gates`` or a
        ``RetentionGates`` module; SmolLM2-135M uses the gates shipped in the package by default.
    prefill_chunk: feed prompts longer than this many tokens in chunks, evicting after each,
        so the prefill holds about budget + chunk instead of the whole prompt. Forwards that
        carry images or videos are prefilled in one piece.
    attention_backend: decode attention: "auto" (the Triton paged kernel on CUDA when triton
        imports, PyTorch otherwise), "torch", or "triton" (raises where it cannot run).
    strategy: for ``polykv``: a strategy JSON written by ``vlm-kv calibrate`` or a ``Strategy``;
        SmolLM2-135M uses the strategy shipped in the package by default.
    tiers: "int2" keeps windows of ``window`` tokens in full precision, in INT2 (2-bit, still
        attended, can be promoted back) or evicted, ranked by the policy's scores under the same
        byte budget (QEvict's recoverable tiers); ``qevict`` and ``kivi2`` are tiered by themselves.
        The policy's scores decide what ranking means: ``streaming_llm`` ranks by recency (sinks and
        the newest windows FP, the next newest INT2, the oldest evicted: KIVI's split under a
        budget), ``random`` ranks windows at random (the floor for tiered policies, as it is
        untiered). ``fastv``, ``visionzip``, ``dbtrimkv_threshold`` and ``polykv`` refuse tiers.
    int2_share: with tiers, the share of the routed bytes spent on INT2 windows when something
        must be evicted (default 0.7), in [0, 1). dbtrimkv's default follows the budget instead:
        0.5 up to a budget of 0.1, 0.3 from 0.25, linear between (``TierConfig.int2_share_by_budget``).
    window: with tiers, tokens per window (default 8; 32 for kivi2).
    key_rope: with tiers, quantize keys as cached ("post" RoPE, the default) or rotated back to
        "pre" RoPE at their positions (KIVI's per-channel outliers; standard RoPE only).
    int2_value: with tiers, split FP / INT2 by value per byte instead of ``int2_share``: an INT2
        window counts as this fraction (0-1] of its FP worth, and each routing group keeps the mix
        of FP and INT2 windows worth the most within its bytes (``TierConfig.int2_value``).
    spill: with tiers, keep the original full-precision keys and values of every quantized window
        in host memory (CPU, pinned on CUDA) so promotion back to FP is lossless. Those host bytes
        are NOT counted against ``budget`` (a device budget); ``kv_bytes()["per_tier"]["spill"]``
        reports them. Default off.
    fp_unit: with tiers, what FP is chosen by: "window" (QEvict; the default) or "token" (single
        entries by their own scores; INT2 stays per window, with holes where entries are FP; the
        default for dbtrimkv, whose gates score single entries).
    int2_share_by_budget: with tiers and entry routing, ``(b_lo, q_lo, b_hi, q_hi)``: the INT2 share
        follows each sequence's budget fraction, linear between the two points (overrides int2_share).
    key_grid: with tiers, how an INT2 window stores its keys' per-channel scale and zero: "fp16"
        (the paper's) or "int8" (8-bit codes of both against three fp16 references per window:
        422 instead of 544 bytes a window at w 8, head_dim 64; see docs/tiers.md).
    basis: with tiers, quantize INT2 windows after a Walsh-Hadamard rotation of keys and values
        ("hadamard", the default except for kivi2: same bytes, spreads outlier channels; the kernels
        rotate the query and the INT2 output instead of the entries) or as stored ("channel", the
        paper's).
    """
    options = {name: value for name, value in locals().items() if name not in ("model", "policy", "budget")}
    key = normalize_policy_name(policy)
    if key == FULL_POLICY:
        _check_full(budget, options)
        get_adapter(model)  # same clear error for unsupported models
        return DynamicCache(config=model.config)
    budget = Budget.parse(DEFAULT_BUDGET if budget is None else budget)
    spec = policy_spec(key)
    gate_kind = spec.gate_kind
    if spec.needs_strategy:
        from vlm_kv.policies.polykv import strategy_kwargs

        scorer_kwargs, allocation_kwargs, gate_kind = strategy_kwargs(model, strategy, scorer_kwargs, allocation_kwargs)
    scorer, alloc, tier_config, evict_every = _plan(key, spec, budget, options, scorer_kwargs, allocation_kwargs)
    adapter = attach(model)
    rotation = None
    if tier_config is not None and tier_config.key_rope == "pre":
        from vlm_kv.rope_keys import KeyRotation

        rotation = KeyRotation.from_model(model, adapter.uses_mrope)
    gate_module = None
    if gate_kind is not None or gates is not None:
        gate_module = _resolve_gates(model, gates, gate_kind or "dbtrimkv", key)
    return CompressedCache(
        adapter, scorer, alloc, budget, evict_every=evict_every, slack=slack, policy_name=key,
        model_id=id(model), seed=seed, gates=gate_module, prefill_chunk=prefill_chunk,
        attention_backend=attention_backend, tiers=tier_config, key_rotation=rotation,
    )


DEFAULT_BUDGET = 0.25
_TIER_OPTIONS = ("int2_share", "window", "key_rope", "spill", "int2_value", "fp_unit", "int2_share_by_budget",
                 "key_grid", "basis")


# make_cache's keyword options and their defaults (what a caller left alone)
_OPTION_DEFAULTS = {p.name: p.default for p in inspect.signature(make_cache).parameters.values()
                    if p.kind is inspect.Parameter.KEYWORD_ONLY}


def check_cache_options(policy: str = "snapkv", budget: Budget | float | int | None = None, **options: Any) -> None:
    """Every check ``make_cache`` makes that needs no model: the policy name, the budget's spelling
    and range, what ``"full"`` refuses, the tier options and which policies take them, the budget
    rule of policies that keep what their own rule says (``kivi2``, ``dbtrimkv_threshold``) and a
    token budget's room for the sinks. Command lines call it before loading a model, so a bad
    argument fails in a second instead of after the model loads. Raises what make_cache raises."""
    defaults = _OPTION_DEFAULTS
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise TypeError(f"unknown cache option(s) {', '.join(unknown)}; known: {', '.join(defaults)}")
    options = {**defaults, **options}
    key = normalize_policy_name(policy)
    if key == FULL_POLICY:
        _check_full(budget, options)
        return
    spec = policy_spec(key)
    budget = Budget.parse(DEFAULT_BUDGET if budget is None else budget)
    if spec.needs_strategy:  # its scorer and allocation come from a strategy, read with the model
        _tier_config(key, spec, None, options["tiers"], _tier_options(options))
        return
    _plan(key, spec, budget, options, options["scorer_kwargs"], options["allocation_kwargs"])


def _check_full(budget: Budget | float | int | None, options: dict[str, Any]) -> None:
    """``"full"`` keeps every token: refuse a budget and options it would otherwise ignore."""
    if budget is not None and Budget.parse(budget) != Budget(fraction=1.0):
        raise BudgetError(
            f"policy 'full' is the uncompressed cache and keeps every token: it takes no budget (got "
            f"{Budget.parse(budget).describe()}); leave the budget out or pass 1.0"
        )
    defaults = _OPTION_DEFAULTS
    ignored = [f"{name}=" for name, value in options.items()
               if value != defaults[name] and not (name == "tiers" and value == "none") and value is not False]
    if ignored:
        raise ValueError(f"policy 'full' compresses nothing, so {', '.join(ignored)} would be ignored: drop "
                         f"{'it' if len(ignored) == 1 else 'them'} or choose a compressing policy")


def _tier_options(options: dict[str, Any]) -> dict[str, Any]:
    return {name: options[name] for name in _TIER_OPTIONS if options[name] is not None}


def _plan(key: str, spec, budget: Budget, options: dict[str, Any], scorer_kwargs: dict[str, Any] | None,
          allocation_kwargs: dict[str, Any] | None) -> tuple[Any, Any, TierConfig | None, int]:
    """(scorer, allocation, tier config, eviction interval) of a compressed cache, every option
    checked against the policy and the budget."""
    if options["strategy"] is not None and not spec.needs_strategy:
        raise ValueError(f"strategy= is for policy 'polykv', not {key!r}")
    scorer, alloc = build_policy(key, options["allocation"], scorer_kwargs, allocation_kwargs)
    tier_config = _tier_config(key, spec, alloc, options["tiers"], _tier_options(options))
    evict_every = options["evict_every"]
    if evict_every is None:
        evict_every = tier_config.window if tier_config is not None else 16
    slack = options["slack"]
    if not alloc.bounded_by_budget and budget != Budget(fraction=1.0):
        raise BudgetError(
            f"policy {key!r} keeps what its own rule says, whatever the budget: pass budget=1.0 "
            f"(got {budget.describe()}); its memory follows the content"
        )
    if budget.tokens_per_head is not None and budget.tokens_per_head - slack < scorer.sinks:
        raise BudgetError(
            f"budget too small: {budget.tokens_per_head} tokens per KV head (minus slack {slack}) cannot hold "
            f"the {scorer.sinks} attention sinks policy {key!r} always keeps; raise the budget"
        )
    prefill_chunk = options["prefill_chunk"]
    if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or int(prefill_chunk) < 1):
        raise ValueError(f"prefill_chunk must be a positive number of tokens, got {prefill_chunk!r}")
    return scorer, alloc, tier_config, evict_every


def _tier_config(key: str, spec, alloc, tiers: str | None, options: dict[str, Any]) -> TierConfig | None:
    """The tiering a cache gets from ``tiers=``, the policy (qevict and kivi2 are tiered) and the
    tier ``options`` the caller gave (``make_cache``'s tier keywords that are not None)."""
    if tiers is not None and tiers not in ("int2", "none"):
        raise ValueError(f"tiers must be 'int2' (or 'none'), got {tiers!r}")
    if tiers is None and spec.default_tiers is not None:
        tiers = "int2"
    if tiers in (None, "none"):
        if spec.default_tiers is not None:
            raise ValueError(f"policy {key!r} is a tiered cache: it cannot run with tiers='none'")
        given = [f"{name}=" for name, value in options.items() if value is not False]  # spill=False asks nothing
        if given:
            raise ValueError(f"{', '.join(given)} configure the INT2 tier: pass tiers='int2' too")
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
    splits = [f"{name}=" for name in ("int2_share", "int2_value", "int2_share_by_budget") if name in options]
    if len(splits) > 1:
        raise ValueError(f"{' and '.join(splits)} are ways to split FP / INT2: pass one of them")
    fields = dict(spec.default_tiers if spec.default_tiers is not None else spec.tier_settings or {})
    # the policy's FP / INT2 split gives way to the caller's: a fixed share holds at every budget, the
    # value split routes whole windows (entry settings do not apply) and a budget schedule needs entry routing
    if "int2_value" in options and "fp_unit" not in options:
        fields = {k: v for k, v in fields.items() if k not in ("fp_unit", "int2_share", "int2_share_by_budget")}
    if options.get("fp_unit", "token") != "token" or "int2_share" in options:
        fields.pop("int2_share_by_budget", None)
    if "int2_value" in options:
        reduce = getattr(spec.scorer, "window_reduce", None)
        if reduce not in ("sum", "logsumexp"):
            raise ValueError(f"int2_value= splits FP / INT2 by the value of windows, which needs additive window "
                             f"scores; policy {key!r} reduces its windows by {reduce!r}: use int2_share= instead")
    fields.update(options)
    if "int2_share_by_budget" in fields:
        fields["int2_share_by_budget"] = tuple(fields["int2_share_by_budget"])
    return TierConfig(**fields)


def _resolve_gates(model: torch.nn.Module, gates: "str | torch.nn.Module | None", kind: str, policy: str) -> torch.nn.Module:
    if gates is None:
        gates = default_gates_for(model, kind=kind)
        if gates is None:
            raise ValueError(
                f"policy {policy!r} needs retention gates for this model: pass gates=DIR "
                "(train them with `vlm-kv train-gates`)"
            )
    if isinstance(gates, str):
        module = load_gates(gates, model=model)
    elif isinstance(gates, RetentionGates):
        check_fits(gates.config, model)
        module = gates
    else:
        raise TypeError(f"gates must be a folder or a RetentionGates module, got {type(gates).__name__}")
    param = next(model.parameters())
    return module.to(param.device).eval()
