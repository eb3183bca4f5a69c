"""Stable descending order of scores through integer keys.

``torch.argsort(..., stable=True)`` on CPU sorts integers by radix, about 5-10x faster than it
sorts floats (330K scores, one thread: float32 34 ms, int32 3 ms, int64 6 ms). A float's bits,
read as a signed integer with the magnitude bits of negatives flipped, order exactly as the
floats do, so sorting those keys gives the same permutation, ties included.
"""

from __future__ import annotations

import torch

_SAME_WIDTH_INT = {torch.float64: torch.int64, torch.float32: torch.int32,
                   torch.float16: torch.int16, torch.bfloat16: torch.int16}


def order_keys(scores: torch.Tensor) -> torch.Tensor:
    """Integers of the same width as ``scores`` that order as the scores do, larger first under
    ``argsort`` (that is, ascending keys give descending scores). No NaN allowed."""
    int_type = _SAME_WIDTH_INT[scores.dtype]
    bits = (scores + 0.0).view(int_type)  # + 0.0: -0.0 becomes +0.0, which compares equal to it
    magnitude = torch.iinfo(int_type).max
    ascending = torch.where(bits < 0, bits ^ magnitude, bits)  # negatives: a larger magnitude sorts lower
    return ~ascending  # ~x = -x - 1 reverses the order and keeps ties tied


def descending_order(scores: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``torch.argsort(scores, dim=dim, descending=True, stable=True)``, the same permutation."""
    if scores.device.type != "cpu" or scores.dtype not in _SAME_WIDTH_INT or bool(torch.isnan(scores).any()):
        return torch.argsort(scores, dim=dim, descending=True, stable=True)
    return torch.argsort(order_keys(scores), dim=dim, stable=True)
