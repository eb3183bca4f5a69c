"""How much KV memory a compressed cache may hold.

A budget is either a fraction of what the full (uncompressed) cache would hold for the tokens
seen so far (a float in (0, 1]), or an average number of tokens per KV head (an int >= 2). Both
resolve, for a sequence with ``n`` real (non-padding) tokens, to a per-head capacity in tokens;
allocations then decide how that capacity is spread over layers and heads while the total stays
``layers * heads * cap``.
"""

from __future__ import annotations

import argparse
import math
import numbers
import os
from dataclasses import dataclass, field

import torch

from vlm_kv.kernels.int2 import INT2_BASES, KEY_GRIDS

#: the text shipped in the package: what the demo and the bench read when given none (offline)
EMBEDDED_TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "frankenstein_letter1.txt")

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

    try:
        return budget_value(text)
    except BudgetError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _tier_field(default, flag: str, help: str, choices: tuple[str, ...] | None = None):  # noqa: A002
    """A TierConfig field that every command with ``--tiers`` exposes as ``flag`` (vlm_kv.arguments.tier_flags)."""
    return field(default=default, metadata={"flag": flag, "help": help, "choices": choices})


@dataclass(frozen=True)
class TierConfig:
    """Recoverable tiers (QEvict): full precision, INT2, evicted, routed per window.

    ``int2_share`` (q): the share of the routed bytes spent on INT2 windows when something must
    be evicted (0.7 in QEvict's main results). ``window`` (w): tokens per window, also the decode
    steps between routing events. ``quantize_all``: every complete window outside the protected
    zones goes to INT2 and nothing is evicted, whatever the budget (KIVI's recipe).
    ``spill``: keep the original full-precision keys and values of every quantized window in host
    memory (the spill tier), so a promotion restores them exactly instead of dequantizing. Host
    bytes, reported as ``kv_bytes()["per_tier"]["spill"]``, are not counted against the (device)
    byte budget; evicting a window frees its copy. Off by default.
    ``int2_value`` (v, optional): split by value per byte instead of the fixed share. A window
    kept in INT2 is worth v times what it is worth in FP (its linear score: attention mass, or
    the summed retention of gated scores); each group takes the number of top windows in FP, and
    as many next ones in INT2 as the rest of its bytes buy, that maximizes the value held. So the
    INT2 share follows the scores: a generous budget, whose next windows are worth little,
    quantizes few; a tight one, many. ``int2_share`` is then unused.
    ``fp_unit``: what the FP tier is chosen by. ``"window"`` (QEvict): whole windows.
    ``"token"``: single entries by their own scores, INT2 still by windows, which may then have
    holes (``vlm_kv.tiers.entry_router``).
    ``int2_share_by_budget`` (``(b_lo, q_lo, b_hi, q_hi)``, token routing only): the INT2 share
    follows each sequence's budget fraction b: ``q_lo`` at or below ``b_lo``, ``q_hi`` at or above
    ``b_hi``, linear between; ``int2_share`` is then unused.
    ``key_grid``: the keys' per-channel grid of an INT2 window, ``"fp16"`` scale and zero (the
    paper's) or ``"int8"`` (their 8-bit codes against three fp16 references per window;
    ``vlm_kv.kernels.int2``), which makes a window 22 % cheaper at w 8, head_dim 64.
    ``basis``: the basis windows are quantized in, ``"channel"`` (the paper's) or ``"hadamard"``
    (keys and values rotated by a Walsh-Hadamard matrix first; same bytes, less error).
    """

    int2_share: float = _tier_field(0.7, "--int2-share", "share of the routed bytes spent on INT2 when something "
                                    "must go")
    window: int = _tier_field(8, "--window", "tokens per INT2 window (also the decode steps between routings)")
    quantize_all: bool = False  # KIVI's recipe: chosen by a policy (kivi2), no flag
    key_rope: str = _tier_field("post", "--key-rope", "quantize keys as cached (post-RoPE) or rotated back to "
                                "pre-RoPE", choices=("post", "pre"))
    spill: bool = _tier_field(False, "--spill", "keep the original FP keys/values of quantized windows in host "
                              "memory so promotion is lossless (host bytes, outside the budget; the 'spill' tier)")
    int2_value: float | None = _tier_field(None, "--int2-value", "split FP / INT2 by value per byte instead of "
                                           "--int2-share, an INT2 window counting as this fraction of its FP "
                                           "worth (0-1]")
    fp_unit: str = _tier_field("window", "--fp-unit", "choose FP by whole windows (QEvict) or by single entries "
                               "(INT2 stays per window)", choices=("window", "token"))
    int2_share_by_budget: tuple[float, float, float, float] | None = None  # a policy's schedule, no flag
    # the compact grid (ours) beats the paper's fp16 grid on four pg84 passages at 0.05 / 0.1 / 0.25 for
    # dbtrimkv and at 0.05 / 0.1 for H2O window mass (bf16; docs/tiers.md, session 8); kivi2 keeps the
    # published fp16 grid (qevict takes this one: policies/catalog.py)
    key_grid: str = _tier_field("int8", "--key-grid", "the keys' per-channel scale/zero of an INT2 window in "
                                "fp16 (the paper's) or as 8-bit codes (int8: a window 22%% cheaper at w 8, "
                                "head_dim 64)", choices=KEY_GRIDS)
    # the Hadamard basis (ours) beats the channel basis for dbtrimkv on eight passages (pg84, pg1342) at
    # 0.1 (mean KL -15 %) and 0.25 (-27 %), ties it at 0.05, and wins every qevict cell measured (bf16;
    # docs/tiers.md, session 9); kivi2 keeps KIVI's channel basis
    basis: str = _tier_field("hadamard", "--int2-basis", "quantize INT2 windows after a Walsh-Hadamard rotation "
                             "of keys and values (hadamard: same bytes), of the keys only (hadamard_keys) or "
                             "per channel as stored (channel, the paper's)", choices=INT2_BASES)

    def __post_init__(self) -> None:
        if self.basis not in INT2_BASES:
            raise ValueError(f"basis must be one of {INT2_BASES}, got {self.basis!r}")
        if self.key_grid not in KEY_GRIDS:
            raise ValueError(f"key_grid must be one of {KEY_GRIDS}, got {self.key_grid!r}")
        if self.fp_unit not in ("window", "token"):
            raise ValueError(f"fp_unit must be 'window' or 'token', got {self.fp_unit!r}")
        if self.fp_unit == "token" and (self.quantize_all or self.int2_value is not None):
            raise ValueError("fp_unit='token' splits FP / INT2 by int2_share; quantize_all and int2_value route "
                             "whole windows: use fp_unit='window' with them")
        sched = self.int2_share_by_budget
        if sched is not None:
            if self.fp_unit != "token":
                raise ValueError("int2_share_by_budget is applied by the entry router: pass fp_unit='token'")
            if (len(sched) != 4 or not 0.0 < sched[0] < sched[2] <= 1.0
                    or not all(0.0 <= q < 1.0 for q in (sched[1], sched[3]))):
                raise ValueError(f"int2_share_by_budget must be (b_lo, q_lo, b_hi, q_hi) with 0 < b_lo < b_hi <= 1 "
                                 f"and shares in [0, 1), got {sched!r}")
        if self.key_rope not in ("post", "pre"):
            raise ValueError(f"key_rope must be 'post' or 'pre', got {self.key_rope!r}")
        q = self.int2_share
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not (0.0 <= q < 1.0):
            raise ValueError(f"int2_share must be in [0, 1), got {q!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be an integer >= 1 (tokens per INT2 window), got {self.window!r}")
        if not isinstance(self.spill, bool):
            raise ValueError(f"spill must be True or False, got {self.spill!r}")
        v = self.int2_value
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not (0.0 < v <= 1.0)):
            raise ValueError(f"int2_value must be in (0, 1] (an INT2 window's worth relative to FP), got {v!r}")

    def share_for(self, fraction: torch.Tensor) -> torch.Tensor:
        """The INT2 share q for budget fractions ``fraction`` (float tensor)."""
        if self.int2_share_by_budget is None:
            return torch.full_like(fraction, float(self.int2_share))
        b_lo, q_lo, b_hi, q_hi = self.int2_share_by_budget
        t = ((fraction - b_lo) / (b_hi - b_lo)).clamp(0.0, 1.0)
        return q_lo + t * (q_hi - q_lo)


ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class CacheOptions:
    """How a compressed cache runs, whatever its policy; ``make_cache(options=CacheOptions(...))``.

    ``evict_every``: decode steps between eviction steps (one always follows each prefill); None
    gives 16, or the tier window for a tiered cache (QEvict routes every w steps).
    ``prefill_chunk``: feed prompts longer than this many tokens in chunks, evicting after each, so
    the prefill holds about budget + chunk instead of the whole prompt (forwards that carry images
    or videos are prefilled in one piece).
    ``slack``: tokens per head kept free below the budget at each step.
    ``seed``: the random policy's seed (each sequence draws from its own stream).
    ``attention_backend``: decode attention, "auto" (the Triton paged kernel on CUDA when triton
    imports; on CPU, tiered decode steps through the C++ kernel ``vlm_kv.kernels.int2_cpu`` when
    it builds, built once on first use; PyTorch otherwise), "torch" (the pure PyTorch path), or
    "triton" (raises where it cannot run).
    ``allocation``: override how the budget is spread (uniform, pyramid, adaptive, global).
    ``scorer_kwargs`` / ``allocation_kwargs``: fields of the policy's scorer / allocation dataclass
    (e.g. ``{"window": 8}`` for snapkv's observation window).
    ``layerwise_prefill``: a prompt (or each of its chunks) is evicted, or routed between tiers, in
    each layer right after that layer's attention, so its full keys and values never sit in every
    layer at once; the same entries are kept as by one step at the end of the forward (False: that
    step, which holds the whole prompt in every layer until the forward ends). A global ranking
    (dbtrimkv) drops early only what can no longer be chosen; tiered, it routes at the end.
    """

    evict_every: int | None = None
    prefill_chunk: int | None = None
    slack: int = 0
    seed: int = 0
    attention_backend: str = "auto"
    allocation: str | None = None
    scorer_kwargs: dict | None = None
    allocation_kwargs: dict | None = None
    layerwise_prefill: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.layerwise_prefill, bool):
            raise TypeError(f"layerwise_prefill must be True or False, got {self.layerwise_prefill!r}")
        e = self.evict_every
        if e is not None and (isinstance(e, bool) or not isinstance(e, int) or e < 1):
            raise ValueError(f"evict_every must be an integer >= 1 (decode steps), got {e!r}")
        p = self.prefill_chunk
        if p is not None and (isinstance(p, bool) or not isinstance(p, int) or p < 1):
            raise ValueError(f"prefill_chunk must be a positive number of tokens, got {p!r}")
        if isinstance(self.slack, bool) or not isinstance(self.slack, int) or self.slack < 0:
            raise ValueError(f"slack must be an integer >= 0 (tokens per head), got {self.slack!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be 'auto', 'torch' or 'triton', got {self.attention_backend!r}")
        for name in ("scorer_kwargs", "allocation_kwargs"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, dict):
                raise TypeError(f"{name} must be a dict of the {name.split('_')[0]}'s fields, got {type(value).__name__}")

    def eviction_interval(self, tiers: "TierConfig | None") -> int:
        """``evict_every``, or its default: the tier window for a tiered cache, else 16."""
        if self.evict_every is not None:
            return self.evict_every
        return tiers.window if tiers is not None else 16
