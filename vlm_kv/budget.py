"""How much KV memory a compressed cache may hold.

A budget is either a fraction of what the full (uncompressed) cache would hold for the tokens
seen so far (a float in (0, 1]), or an average number of tokens per KV head (an int >= 2). Both
resolve, for a sequence with ``n`` real (non-padding) tokens, to a per-head capacity in tokens;
allocations then decide how that capacity is spread over layers and heads while the total stays
``layers * heads * cap``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass


#: what every --budget / --budgets option says (one wording everywhere)
BUDGET_HELP = ("a fraction of the full cache in (0, 1], written with a decimal point (0.25; 1.0 = the whole "
               "cache), or an int >= 2: tokens per KV head (256); a bare 1 is refused as ambiguous")


def _number(text: str) -> float | int:
    """A budget typed as text: digits only are an int (tokens per head), anything else a float."""
    text = text.strip()
    try:
        return int(text) if text.lstrip("+-").isdigit() else float(text)
    except ValueError:
        raise BudgetError(f"budget must be a number, got {text!r}") from None


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
        """A float in (0, 1] is a fraction of the full cache (1.0: all of it); an int >= 2 is tokens
        per KV head. Anything else raises BudgetError naming the two spellings: a bare ``1`` (the
        whole cache, or one token?), and a float above 1 (``64.0``: tokens, or a typo?) are refused
        rather than guessed. ``Budget(tokens_per_head=1)`` spells one token per head explicitly.

        Strings from the command line follow the same rule: "0.1" and "1.0" are fractions, "256" tokens.
        """
        if isinstance(value, Budget):
            return value
        if isinstance(value, bool):
            raise BudgetError(f"budget must be a number, got {value!r}")
        if isinstance(value, str):
            value = _number(value)
        if isinstance(value, numbers.Integral):
            return cls._tokens(int(value))
        if isinstance(value, numbers.Real):
            return cls._fraction(float(value))
        raise BudgetError(f"budget must be a float fraction or an int token count, got {type(value).__name__}")

    @classmethod
    def _tokens(cls, value: int) -> "Budget":
        if value == 1:
            raise BudgetError(
                "budget 1 is ambiguous: write 1.0 for the whole cache (a fraction), or an int >= 2 for "
                "tokens per KV head (Budget(tokens_per_head=1) for exactly one)"
            )
        if value <= 0:
            raise BudgetError(f"budget must be > 0, got {value}")
        return cls(tokens_per_head=value)

    @classmethod
    def _fraction(cls, value: float) -> "Budget":
        if math.isnan(value) or value <= 0:
            raise BudgetError(f"budget must be > 0, got {value}")
        if value > 1:
            raise BudgetError(
                f"budget {value:g} is a float above 1: a fraction of the full cache is in (0, 1]; "
                f"for tokens per KV head pass an int ({int(value) if value.is_integer() else 'e.g. 256'})"
            )
        return cls(fraction=value)

    def capacity(self, n_tokens: int) -> int:
        """Average tokens each KV head may keep for a sequence of ``n_tokens`` real tokens."""
        if self.fraction is not None:
            return min(n_tokens, int(math.floor(self.fraction * n_tokens)))
        return min(n_tokens, int(self.tokens_per_head))

    def describe(self) -> str:
        if self.fraction is not None:
            return f"{self.fraction:g} of the full cache"
        return f"{self.tokens_per_head} tokens per KV head"


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
