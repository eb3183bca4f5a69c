"""``make_cache``: the one call users need before ``model.generate(past_key_values=cache)``."""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from vlm_kv import attention
from vlm_kv.budget import Budget, BudgetError
from vlm_kv.cache import CacheMisuseError, CompressedCache
from vlm_kv.models.adapters import ModelAdapter, get_adapter
from vlm_kv.policies import FULL_POLICY, GATED_POLICIES, build_policy


def cache_kwarg(model: torch.nn.Module) -> str:
    """Name under which ``model.generate`` / ``model(...)`` take the cache on this transformers:
    ``cache`` since 5.x renamed it, ``past_key_values`` before."""
    import inspect

    try:
        params = inspect.signature(type(model).prepare_inputs_for_generation).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def _find_inputs(args: tuple, kwargs: dict) -> tuple[torch.Tensor | None, torch.Tensor | None, int | None]:
    input_ids = kwargs.get("input_ids", args[0] if args and isinstance(args[0], torch.Tensor) else None)
    attention_mask = kwargs.get("attention_mask")
    embeds = kwargs.get("inputs_embeds")
    if input_ids is not None:
        q_len = input_ids.shape[1]
    elif embeds is not None:
        q_len = embeds.shape[1]
    else:
        q_len = None
    return input_ids, attention_mask, q_len


def _before_forward(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    # transformers 5.x renames `past_key_values` to `cache`; accept both spellings
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if not isinstance(cache, CompressedCache):
        return
    if cache.model_id is not None and cache.model_id != id(model):
        raise CacheMisuseError(
            "this compressed cache was built for another model "
            f"({cache.adapter.family}, {cache.adapter.num_layers} layers); build a new one with "
            "vlm_kv.make_cache(model, ...) for this model"
        )
    input_ids, attention_mask, q_len = _find_inputs(args, kwargs)
    if q_len is not None:
        cache.set_forward_inputs(input_ids, attention_mask, q_len)


def attach(model: torch.nn.Module, adapter: ModelAdapter | None = None) -> ModelAdapter:
    """Route the language model's attention through vlm_kv (idempotent).

    Only the language model switches; a vision tower keeps its own implementation. With any
    other cache the vlm_kv attention function runs transformers' SDPA path unchanged.
    """
    adapter = adapter or get_adapter(model)
    impl = attention.register()
    if not getattr(model, "_vlm_kv_attached", False):
        if adapter.text_config_key is None:
            model.set_attn_implementation(impl)
        else:
            model.set_attn_implementation({adapter.text_config_key: impl})
        model.register_forward_pre_hook(_before_forward, with_kwargs=True)
        from vlm_kv.gates.hooks import inference_gate_hook

        for module in adapter.attention_modules(model):
            module.register_forward_pre_hook(inference_gate_hook, with_kwargs=True)
        model._vlm_kv_attached = True
    return adapter


def make_cache(
    model: torch.nn.Module,
    policy: str = "snapkv",
    budget: Budget | float | int = 0.25,
    *,
    allocation: str | None = None,
    evict_every: int = 16,
    slack: int = 0,
    seed: int = 0,
    scorer_kwargs: dict[str, Any] | None = None,
    allocation_kwargs: dict[str, Any] | None = None,
    gates: "str | torch.nn.Module | None" = None,
) -> CompressedCache | DynamicCache:
    """A KV cache for ``model`` that holds ``budget`` of the full cache, chosen by ``policy``.

    budget: a float in (0, 1] (fraction of the full cache) or an int (average tokens per KV head).
    policy: one of ``vlm_kv.policies.POLICIES`` or ``"full"`` (a plain DynamicCache).
    allocation: override how the budget is spread: uniform, pyramid, adaptive, global.
    evict_every: decode steps between eviction steps (one always follows each prefill).
    slack: tokens per head kept free below the budget at each step.
    gates: for ``trimkv`` / ``dbtrimkv``: a folder saved by ``vlm-kv train-gates`` or a
        ``RetentionGates`` module; SmolLM2-135M uses the gates shipped in the package by default.
    """
    budget = Budget.parse(budget)
    if policy == FULL_POLICY:
        get_adapter(model)  # same clear error for unsupported models
        return DynamicCache(config=model.config)
    scorer, alloc = build_policy(policy, allocation, scorer_kwargs, allocation_kwargs)
    if budget.tokens_per_head is not None:
        needed = scorer.sinks + scorer.protected_window(budget.tokens_per_head)
        if budget.tokens_per_head - slack < needed:
            raise BudgetError(
                f"budget too small: {budget.tokens_per_head} tokens per KV head (minus slack {slack}) is less "
                f"than the {needed} tokens policy {policy!r} always keeps ({scorer.sinks} sinks + "
                f"{scorer.protected_window(budget.tokens_per_head)} recent)"
            )
    adapter = attach(model)
    gate_module = None
    if policy in GATED_POLICIES or gates is not None:
        gate_module = _resolve_gates(model, gates, policy)
    return CompressedCache(
        adapter, scorer, alloc, budget, evict_every=evict_every, slack=slack, policy_name=policy,
        model_id=id(model), seed=seed, gates=gate_module,
    )


def _resolve_gates(model: torch.nn.Module, gates: "str | torch.nn.Module | None", policy: str) -> torch.nn.Module:
    from vlm_kv.gates import default_gates_for
    from vlm_kv.gates.io import check_fits, load_gates
    from vlm_kv.gates.retention_gate import RetentionGates

    if gates is None:
        gates = default_gates_for(model, kind="trimkv" if policy == "trimkv" else "dbtrimkv")
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
