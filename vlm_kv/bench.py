"""Decode-speed benchmark: time per generated token, compressed cache vs DynamicCache."""

from __future__ import annotations

import statistics
import time

import torch
from transformers import DynamicCache

from vlm_kv.api import cache_kwarg, make_cache
from vlm_kv.fidelity import text_tokens


def _cache_bytes(cache) -> int:
    if hasattr(cache, "kv_bytes"):
        return cache.kv_bytes()["total"]
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


@torch.no_grad()
def _time_decode(model, cache, ids: torch.Tensor, context: int, steps: int, repeats: int) -> tuple[float, int]:
    cache_arg = {cache_kwarg(model): cache}
    model(input_ids=ids[:, :context], **cache_arg, use_cache=True)
    token = ids[:, context : context + 1]
    per_round = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            logits = model(input_ids=token, **cache_arg, use_cache=True).logits
            token = logits[:, -1:].argmax(-1)
        per_round.append((time.perf_counter() - start) * 1000 / steps)
    return statistics.median(per_round), _cache_bytes(cache)


def decode_speed(model, tokenizer, text_path: str, context: int, steps: int, policy: str, budget: float,
                 offset: int = 0, repeats: int = 3) -> list[dict]:
    """Median ms per decoded token after a ``context``-token prefill, for both caches.

    The compressed cache's time includes its eviction steps (every ``evict_every`` tokens).
    """
    ids = text_tokens(tokenizer, text_path, offset, context + 1)
    rows = []
    for label, factory in (
        ("DynamicCache", lambda: DynamicCache(config=model.config)),
        (f"{policy}@{budget}", lambda: make_cache(model, policy=policy, budget=budget)),
    ):
        ms, nbytes = _time_decode(model, factory(), ids, context, steps, repeats)
        rows.append({"cache": label, "context": context, "steps": steps * repeats, "ms_per_token": ms,
                     "kv_bytes": nbytes, "threads": torch.get_num_threads()})
    return rows
