"""What a compressed cache holds, in bytes and in entries.

``kv_bytes`` counts storage as allocated (a tensor's whole storage, spare capacity included):
``total`` is the keys and values, the quantity the budget bounds; ``held`` adds everything
else the cache keeps alive (entry metadata, remembered queries, gate outputs waiting for their
layer), so that it is the whole truth about the cache's memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vlm_kv.cache.tiered_layer import TieredLayer
from vlm_kv.models.adapters import MODALITIES

if TYPE_CHECKING:
    from vlm_kv.cache.cache import CompressedCache


def _stores(cache: "CompressedCache") -> list:
    return [layer.store for layer in cache.layers if layer.store is not None]


def _tiers(cache: "CompressedCache") -> list:
    return [layer.tier for layer in cache.layers if isinstance(layer, TieredLayer) and layer.tier is not None]


def modality_totals(cache: "CompressedCache", weight_by_bytes: bool) -> dict[str, int]:
    """Entries (or bytes) per modality over every tier; an INT2 entry weighs its window's bytes / w."""
    totals = torch.zeros(len(MODALITIES), dtype=torch.long)
    for store in _stores(cache):
        counts = store.modality_counts().cpu()
        totals += counts * (store.bytes_per_entry if weight_by_bytes else 1)
    for tier in _tiers(cache):
        counts = tier.modality_counts(len(MODALITIES)).cpu()
        totals += counts * (tier.window_bytes() // tier.window if weight_by_bytes else 1)
    return {name: int(v) for name, v in zip(MODALITIES, totals.tolist())}


def tier_bytes(cache: "CompressedCache") -> dict[str, int]:
    """Bytes by tier: ``fp`` (keys and values in the model dtype), ``int2`` (2-bit codes of the
    windows attended from the INT2 tier), ``scales`` (their fp16 scales and zeros), ``ledger``
    (codes and grids kept for promoted windows, reused at their next demotion), ``spill`` (host
    memory: the original FP keys and values the spill tier keeps for lossless promotion, 0 unless
    ``TierConfig(spill=True)``). ``spill`` is not device memory and not in ``total``: the byte
    budget does not count it."""
    out = {"fp": sum(store.kv_bytes() for store in _stores(cache)), "int2": 0, "scales": 0, "ledger": 0, "spill": 0}
    for tier in _tiers(cache):
        for key, value in tier.tier_bytes().items():
            out[key] += value
        out["spill"] += tier.spill_bytes()
    return out


def kv_bytes(cache: "CompressedCache") -> dict[str, Any]:
    """Bytes allocated: ``total`` (keys and values, per layer / modality / tier), and ``held``
    (total + metadata + query_window + gate_stash). ``unused`` is the part of ``total`` that is
    spare tail capacity (at most ``evict_every`` tokens per head, released at each eviction step).
    ``total`` and ``held`` are the cache's device memory; the spill tier's host copies are only in
    ``per_tier["spill"]`` (so ``per_tier`` sums to ``total + per_tier["spill"]``)."""
    per_layer = [layer.kv_bytes() for layer in cache.layers]
    total = sum(per_layer)  # = total_kv_bytes(cache)
    metadata = sum(store.meta_bytes() for store in _stores(cache)) + sum(t.meta_bytes() for t in _tiers(cache))
    query_window = sum(layer.query_window_bytes() for layer in cache.layers)
    gate_stash = cache.gate_handoff.held_bytes()
    return {
        "total": total,
        "per_layer": per_layer,
        "per_modality": modality_totals(cache, weight_by_bytes=True),
        "per_tier": tier_bytes(cache),
        "unused": sum(store.unused_bytes() for store in _stores(cache)),
        "metadata": metadata,
        "query_window": query_window,
        "gate_stash": gate_stash,
        "held": total + metadata + query_window + gate_stash,
    }


def total_kv_bytes(cache: "CompressedCache") -> int:
    """``kv_bytes()["total"]`` alone, without the breakdowns (what hot paths track)."""
    return sum(layer.kv_bytes() for layer in cache.layers)


def stats(cache: "CompressedCache") -> dict[str, Any]:
    """Entry counts: total, per layer, per modality, per-head length spread, eviction steps."""
    per_layer = [layer.num_entries() for layer in cache.layers]
    lengths = [layer.head_lengths() for layer in cache.layers if layer.store is not None]
    heads = torch.cat(lengths).float() if lengths else torch.zeros(1)
    return {
        "policy": cache.policy_name,
        "budget": cache.budget.describe(),
        "seen_tokens": cache.get_seq_length(),
        "entries": sum(per_layer),
        "per_layer": per_layer,
        "per_modality": modality_totals(cache, weight_by_bytes=False),
        "head_length": {"min": int(heads.min()), "mean": float(heads.mean()), "max": int(heads.max())},
        "eviction_steps": cache.evictor.eviction_steps,
        "evicted_entries": cache.evictor.evicted_entries,
        "per_tier": tier_stats(cache),
    }


def tier_stats(cache: "CompressedCache") -> dict[str, int]:
    """Entries per tier and the moves between tiers (windows) since the cache was built;
    ``spill_windows`` = windows with a host copy, ``lossless_promotions`` = promotions served from it."""
    tiers = _tiers(cache)
    out = {
        "fp_entries": sum(store.num_entries() for store in _stores(cache)),
        "int2_entries": sum(t.num_entries() for t in tiers),
        "int2_windows": sum(t.num_active for t in tiers),
        "ledger_windows": sum(len(t) - t.num_active for t in tiers),
        "spill_windows": sum(len(t.spill) for t in tiers if t.spill is not None),
    }
    for name in ("quantized", "ledger_reuses", "demotions", "promotions", "evicted_windows"):
        out[name] = sum(getattr(t.counters, name) for t in tiers)
    out["lossless_promotions"] = sum(t.counters.promotions for t in tiers if t.spill is not None)
    return out


def budget_bytes(cache: "CompressedCache") -> int:
    """Bytes the budget allows for the tokens seen so far (what ``kv_bytes()["total"]`` stays under after eviction)."""
    stores = _stores(cache)
    if not stores or cache.ledger.valid_tokens is None:
        return 0
    heads = sum(s.num_kv_heads for s in stores)
    caps = [cache.budget.capacity(int(n)) for n in cache.ledger.valid_tokens.tolist()]
    return sum(caps) * heads * stores[0].bytes_per_entry


def full_kv_bytes(cache: "CompressedCache") -> int:
    """Bytes an uncompressed DynamicCache would hold for the same tokens."""
    return sum(layer.full_bytes() for layer in cache.layers)


def cache_bytes(cache: Any) -> int:
    """Key/value bytes any cache holds: ``kv_bytes()["total"]`` of ours, the layer tensors of a
    transformers cache (DynamicCache and friends)."""
    if hasattr(cache, "kv_bytes"):
        return int(cache.kv_bytes()["total"])
    return layer_tensor_bytes(cache)


def peak_after_eviction(cache: Any) -> int:
    """The most key/value bytes ``cache`` held right after an eviction step: what the budget bounds,
    the one "max KV bytes" every tool reports. A cache that never evicted (a DynamicCache, or a
    compressed cache before its first step) reports what it holds now."""
    if getattr(cache, "eviction_steps", 0):
        return int(cache.max_kv_bytes)
    return cache_bytes(cache)


def layer_tensor_bytes(cache: Any) -> int:
    """Bytes of the key and value tensors of a transformers cache's layers."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.nbytes
    return total
