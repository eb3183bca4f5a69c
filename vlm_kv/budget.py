"""How much KV memory a compressed cache may hold.

A budget is either a fraction of what the full (uncompressed) cache would hold for the tokens
seen so far, or an average number of tokens per KV head. Both resolve, for a sequence with
``n`` real (non-padding) tokens, to a per-head capacity in tokens; allocations then decide how
that capacity is spread over layers and heads while the total stays ``layers * heads * cap``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class BudgetError(ValueError):
    """A budget that cannot be honoured (out of range, or smaller than what a policy protects)."""


@dataclass(frozen=True)
class Budget:
    fraction: float | None = None
    tokens_per_head: int | None = None

    def __post_init__(self) -> None:
        if (self.fraction is None) == (self.tokens_per_head is None):
            raise BudgetError("give exactly one of a fraction or tokens per head")
        if self.fraction is not None and not (0.0 < self.fraction <= 1.0):
            raise BudgetError(
                f"budget fraction must be in (0, 1], got {self.fraction}; "
                "pass an int for an average number of tokens per KV head"
            )
        if self.tokens_per_head is not None and self.tokens_per_head < 1:
            raise BudgetError(f"budget in tokens per KV head must be >= 1, got {self.tokens_per_head}")

    @classmethod
    def parse(cls, value: "Budget | float | int | str") -> "Budget":
        """float in (0, 1] -> fraction of the full cache; int >= 1 -> tokens per KV head.

        Strings from the command line follow the same rule: "0.1" is a fraction, "256" tokens.
        """
        if isinstance(value, Budget):
            return value
        if isinstance(value, bool):
            raise BudgetError(f"budget must be a number, got {value!r}")
        if isinstance(value, str):
            text = value.strip()
            try:
                value = int(text) if text.lstrip("-").isdigit() else float(text)
            except ValueError:
                raise BudgetError(f"budget must be a number, got {text!r}") from None
        if isinstance(value, int):
            if value == 1:
                # "1" reads more naturally as "the whole cache" than as a single token per head.
                return cls(fraction=1.0)
            if value <= 0:
                raise BudgetError(f"budget must be > 0, got {value}")
            return cls(tokens_per_head=value)
        if isinstance(value, float):
            if math.isnan(value) or value <= 0:
                raise BudgetError(f"budget must be > 0, got {value}")
            if value > 1:
                if value.is_integer():
                    return cls(tokens_per_head=int(value))
                raise BudgetError(
                    f"budget fraction must be <= 1, got {value}; pass an int for tokens per KV head"
                )
            return cls(fraction=value)
        raise BudgetError(f"budget must be a float fraction or an int token count, got {type(value).__name__}")

    def capacity(self, n_tokens: int) -> int:
        """Average tokens each KV head may keep for a sequence of ``n_tokens`` real tokens."""
        if self.fraction is not None:
            return min(n_tokens, int(math.floor(self.fraction * n_tokens)))
        return min(n_tokens, int(self.tokens_per_head))

    def describe(self) -> str:
        if self.fraction is not None:
            return f"{self.fraction:g} of the full cache"
        return f"{self.tokens_per_head} tokens per KV head"

    def as_number(self) -> float:
        return self.fraction if self.fraction is not None else float(self.tokens_per_head)


def budget_value(value: "Budget | float | int | str") -> float | int:
    """A budget as the plain number ``make_cache`` takes: "0.25" -> 0.25 (fraction of the full
    cache), "256" -> 256 (tokens per KV head); raises BudgetError naming the problem."""
    budget = Budget.parse(value)
    return budget.fraction if budget.fraction is not None else budget.tokens_per_head


def budget_arg(text: str) -> float | int:
    """argparse type for a budget (see ``budget_value``)."""
    import argparse

    try:
        return budget_value(text)
    except BudgetError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
