"""Giving freed host memory back to the operating system.

glibc keeps freed heap for reuse, and after a large tensor is freed it raises its mmap threshold
(up to 32 MiB), so later tensors of a layer's size come from the heap instead of their own
mappings. A prefill that frees each layer's evicted keys and values then leaves the process's
resident set growing layer after layer although the cache holds a fraction of them: measured on
SmolLM2 at 8192 tokens (qevict, tiers, 0.1), 0.8 GB resident after 25 layers with 47 MB of cache,
about 0.1 GB when the heap is trimmed after each layer (docs/tiered_prefill.md)."""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import lru_cache

__all__ = ["return_freed_heap"]


@lru_cache(maxsize=1)
def _malloc_trim():
    """libc's ``malloc_trim``, or None where there is none (not glibc)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


def return_freed_heap() -> bool:
    """Release the free memory of every heap to the OS; False where the C library cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
