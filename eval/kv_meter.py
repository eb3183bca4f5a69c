"""Bytes a KV cache holds, measured the same way for compressed caches and the full one.

``CacheMeter.make`` is a ``make_cache`` stand-in for the runners: it builds the cache the
runner asked for and, when the next cache is made (or at ``close``), records the bytes the
previous one held (mean) and its peak. A plain ``DynamicCache`` (the full cache) is given a
``kv_bytes()`` method so it reports like the compressed caches.
"""

from __future__ import annotations

from vlm_kv.api import make_cache
from vlm_kv.cache.report import layer_tensor_bytes
from vlm_kv.eval.retrieval import cache_bytes as _bytes

__all__ = ["CacheMeter", "MeteredDynamicCache", "cache_bytes"]


def cache_bytes(cache) -> tuple[int, int]:
    """(bytes held now, peak bytes) of a cache; see ``vlm_kv.eval.retrieval.cache_bytes``."""

    return _bytes(cache)


class CacheMeter:
    """A ``make_cache`` wrapper that records the bytes each finished cache held.

    Keeps only the newest cache alive: a cache is measured when the next one is made (the
    runners make one per problem / dialog) or at :meth:`close`. Empty caches (the runners'
    settings check) are not counted.
    """

    def __init__(self):
        self.held: list[int] = []
        self.peak: list[int] = []
        self._last = None

    def _collect(self) -> None:
        cache, self._last = self._last, None
        if cache is None:
            return
        try:
            seen = cache.get_seq_length()
        except Exception:  # noqa: BLE001 - an unfilled DynamicCache layer
            seen = 0
        if seen:
            held, peak = cache_bytes(cache)
            self.held.append(held)
            self.peak.append(peak)

    def make(self, model, policy, budget, **kwargs):
        self._collect()
        cache = make_cache(model, policy=policy, budget=budget, **kwargs)
        if not hasattr(cache, "kv_bytes"):  # the full cache: report its bytes like the others
            cache = MeteredDynamicCache.wrap(cache)
        self._last = cache
        return cache

    def close(self) -> dict:
        self._collect()
        if not self.held:
            return {"kv_bytes": None, "max_kv_bytes": None}
        return {"kv_bytes": int(round(sum(self.held) / len(self.held))), "max_kv_bytes": max(self.peak)}


class MeteredDynamicCache:
    """Mixin factory: a DynamicCache that also answers ``kv_bytes()`` like the compressed caches."""

    _classes: dict = {}

    @classmethod
    def wrap(cls, cache):
        base = type(cache)
        sub = cls._classes.get(base)
        if sub is None:

            def kv_bytes(self):
                return {"total": layer_tensor_bytes(self)}

            sub = type(f"Metered{base.__name__}", (base,), {"kv_bytes": kv_bytes})
            cls._classes[base] = sub
        cache.__class__ = sub
        return cache

