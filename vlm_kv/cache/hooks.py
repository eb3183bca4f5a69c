"""The hooks that connect a stock transformers model to a compressed cache, without touching its code.

``attach`` switches the language model's attention to the registered ``vlm_kv`` function and
adds three hooks: a forward pre-hook that tells the cache what the inputs say (and feeds a long
prompt in chunks when asked), a forward post-hook that closes the forward (hand-off checks,
eviction), and a pre-hook on every self-attention module that runs the retention gates of a
gated cache on the hidden state the q/k/v projections see.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from vlm_kv.attention import handoff
from vlm_kv.cache.cache import CompressedCache
from vlm_kv.models.adapters import ModelAdapter, get_adapter
from vlm_kv.storage.ledger import CacheMisuseError

# inputs whose tokens belong to images or videos: a forward carrying them is prefilled in one
# piece, because the model computes M-RoPE positions and merges vision features over the
# whole input
_VISION_INPUTS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "image_sizes")


def _cache_of(kwargs: dict) -> Any:
    # transformers 5.x renames `past_key_values` to `cache`; accept both spellings
    cache = kwargs.get("cache")
    return cache if cache is not None else kwargs.get("past_key_values")


@contextmanager
def eager_attention(model: torch.nn.Module) -> Iterator[ModelAdapter]:
    """Eager attention for the block (the only implementation that returns probabilities with
    ``output_attentions``), then the implementation the language model had; yields its adapter."""
    adapter = get_adapter(model)
    before = language_attn_implementation(model, adapter)
    model.set_attn_implementation("eager")
    try:
        yield adapter
    finally:
        if before is not None and before != "eager":
            model.set_attn_implementation(before)


def language_attn_implementation(model: torch.nn.Module, adapter: ModelAdapter) -> str | None:
    config = model.config
    if adapter.text_config_key is not None:
        config = getattr(config, adapter.text_config_key, config)
    return getattr(config, "_attn_implementation", None)


def _query_length(args: tuple, kwargs: dict) -> tuple[torch.Tensor | None, int | None]:
    input_ids = kwargs.get("input_ids", args[0] if args and isinstance(args[0], torch.Tensor) else None)
    if input_ids is not None:
        return input_ids, input_ids.shape[1]
    embeds = kwargs.get("inputs_embeds")
    return None, (embeds.shape[1] if embeds is not None else None)


def _slice_inputs(kwargs: dict, q_len: int, start: int, end: int) -> dict:
    """The forward kwargs of tokens ``start:end`` of a ``q_len``-token input."""
    out = dict(kwargs)
    for name in ("input_ids", "inputs_embeds", "token_type_ids", "mm_token_type_ids"):
        if out.get(name) is not None:
            out[name] = out[name][:, start:end]
    mask = out.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        out["attention_mask"] = mask[:, : mask.shape[1] - q_len + end]
    pos = out.get("position_ids")
    if isinstance(pos, torch.Tensor):
        out["position_ids"] = pos[..., start:end]
    cache_position = out.get("cache_position")
    if isinstance(cache_position, torch.Tensor):
        out["cache_position"] = cache_position[start:end]
    return out


def _takes_logits_to_keep(model: torch.nn.Module) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def _before_forward(model: torch.nn.Module, args: tuple, kwargs: dict):
    cache = _cache_of(kwargs)
    if not isinstance(cache, CompressedCache):
        return None
    if cache.model_id is not None and cache.model_id != id(model):
        raise CacheMisuseError(
            "this compressed cache was built for another model "
            f"({cache.adapter.family}, {cache.adapter.num_layers} layers); build a new one with "
            "vlm_kv.make_cache(model, ...) for this model"
        )
    impl = language_attn_implementation(model, cache.adapter)
    if impl != handoff.ATTN_IMPLEMENTATION:
        raise handoff.AttentionBypassError(
            f"the language model's attention implementation is {impl!r}, not {handoff.ATTN_IMPLEMENTATION!r}: "
            "it was switched after make_cache (e.g. model.set_attn_implementation), and the compressed "
            "cache would be bypassed; call vlm_kv.make_cache (or vlm_kv.attach) on the model again"
        )
    input_ids, q_len = _query_length(args, kwargs)
    if not cache.in_chunk_loop:  # a user's call (not one of the chunks this hook feeds)
        cache.call_started_empty = cache.is_empty()
    chunk = cache.prefill_chunk
    if chunk is not None and q_len is not None and q_len > chunk and not any(
        kwargs.get(name) is not None for name in _VISION_INPUTS
    ):
        if args:
            kwargs = dict(kwargs, input_ids=args[0])
            args = ()
        last = ((q_len - 1) // chunk) * chunk
        cache.in_chunk_loop = True
        try:
            for start in range(0, last, chunk):
                piece = _slice_inputs(kwargs, q_len, start, start + chunk)
                if _takes_logits_to_keep(model):
                    piece["logits_to_keep"] = 1  # earlier chunks' logits are never read
                model(**piece)
        finally:
            cache.in_chunk_loop = False
        cache.chunked_prefills += 1
        kwargs = _slice_inputs(kwargs, q_len, last, q_len)
        input_ids, q_len = _query_length((), kwargs)
        cache.begin_forward(input_ids, kwargs.get("attention_mask"), q_len)
        return args, kwargs
    cache.begin_forward(input_ids, kwargs.get("attention_mask"), q_len)
    return None


def _after_forward(model: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    cache = _cache_of(kwargs)
    if not isinstance(cache, CompressedCache):
        return None
    if output is None:  # the forward raised (always_call): do not judge a half-run forward
        cache.abort_forward()
        return None
    cache.end_forward()
    return None


def inference_gate_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Compute log beta of the new tokens for a compressed cache that carries gates."""
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    cache = _cache_of(kwargs)
    if isinstance(cache, CompressedCache) and cache.gates is not None and hidden is not None:
        if hidden.shape[1] == 1:  # a decode step: batched with every layer at the end of the forward
            cache.gate_handoff.defer(module.layer_idx, hidden)
            return
        with torch.no_grad():
            cache.gate_handoff.stash_log_beta(module.layer_idx, cache.gates.log_beta(module.layer_idx, hidden))


def attach(model: torch.nn.Module, adapter: ModelAdapter | None = None) -> ModelAdapter:
    """Route the language model's attention through vlm_kv (idempotent; re-run after switching it away).

    Only the language model switches; a vision tower keeps its own implementation. With any
    other cache the vlm_kv attention function runs transformers' SDPA path unchanged.
    """
    adapter = adapter or get_adapter(model)
    impl = handoff.register()
    if language_attn_implementation(model, adapter) != impl:
        if adapter.text_config_key is None:
            model.set_attn_implementation(impl)
        else:
            model.set_attn_implementation({adapter.text_config_key: impl})
    if not getattr(model, "_vlm_kv_attached", False):
        model.register_forward_pre_hook(_before_forward, with_kwargs=True)
        model.register_forward_hook(_after_forward, with_kwargs=True, always_call=True)
        for module in adapter.attention_modules(model):
            module.register_forward_pre_hook(inference_gate_hook, with_kwargs=True)
        model._vlm_kv_attached = True
    return adapter
