"""A PolyKV strategy: for every layer and phase, which pattern evicts and how much the layer keeps.

One JSON file, written offline by ``vlm-kv calibrate`` and loaded by ``make_cache(policy="polykv",
strategy=...)``. Units: ``LayerEntry.budget`` is the share of the whole cache (all layers) that a
layer holds, so within a phase the layers' budgets sum to the strategy's global ``budget``
(a fraction of the full cache); a layer holding its full cache has budget ``1 / num_layers``.
At run time only the ratios between layers matter: a cache built with another global budget
scales every layer alike.

Like gates, a strategy names the model it was calibrated for (the adapter's fingerprint) and
refuses to load for another one.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from vlm_kv.models.adapters import get_adapter
from vlm_kv.policies.catalog import (
    COMBINED_POLICY,
    FULL_POLICY,
    LAYER_POLICIES,
    UnknownPolicyError,
    normalize_policy_name,
)

PHASES = ("prefill", "decode")
MODALITIES = ("text", "image", "video")
FORMAT_VERSION = 1
#: how far the layers' budgets may sum away from the global budget (relative)
SUM_TOLERANCE = 1e-3


class StrategyError(ValueError):
    """A strategy file that is malformed, inconsistent, or calibrated for another model."""


@dataclass
class LayerEntry:
    """What one layer does in one phase: its pattern (a policy name) and its share of the cache.

    ``modality``: optional split of this layer's budget between modalities (shares summing to 1).
    ``signals``: the measurements that chose this entry (KL per candidate, sensitivity, ...).
    """

    pattern: str
    budget: float
    modality: dict[str, float] | None = None
    signals: dict[str, Any] = field(default_factory=dict)


@dataclass
class Strategy:
    model: dict[str, Any]                 # adapter fingerprint of the calibrated model
    budget: float                         # global budget (fraction of the full cache) calibrated for
    layers: dict[str, list[LayerEntry]]   # phase -> one entry per layer
    floor: float = 0.0                    # least budget any layer gets (same units as LayerEntry.budget)
    candidates: list[str] = field(default_factory=list)
    calibration: dict[str, Any] = field(default_factory=dict)  # data, lengths, seed, ...
    version: int = FORMAT_VERSION

    # ------------------------------------------------------------ views
    @property
    def num_layers(self) -> int:
        return len(next(iter(self.layers.values())))

    def phase(self, phase: str) -> list[LayerEntry]:
        """Entries of ``phase``; a strategy with one phase uses it for both."""
        if phase not in PHASES:
            raise StrategyError(f"unknown phase {phase!r}; known: {', '.join(PHASES)}")
        if phase in self.layers:
            return self.layers[phase]
        return next(iter(self.layers.values()))

    def relative_shares(self, phase: str) -> list[float]:
        """Each layer's budget divided by the mean: 1.0 everywhere is a uniform allocation."""
        budgets = [e.budget for e in self.phase(phase)]
        mean = sum(budgets) / len(budgets)
        return [b / mean for b in budgets]

    def patterns(self) -> set[str]:
        return {e.pattern for entries in self.layers.values() for e in entries}

    # ------------------------------------------------------------ ablations
    def with_uniform_budgets(self) -> "Strategy":
        """Same patterns, every layer the same share (the pattern-choice-only ablation)."""
        share = self.budget / self.num_layers
        layers = {phase: [LayerEntry(e.pattern, share, e.modality, dict(e.signals)) for e in entries]
                  for phase, entries in self.layers.items()}
        return Strategy(model=dict(self.model), budget=self.budget, layers=layers, floor=min(self.floor, share),
                        candidates=list(self.candidates),
                        calibration=dict(self.calibration, ablation="uniform budgets")).validate()

    def with_pattern(self, pattern: str) -> "Strategy":
        """Same budgets, one pattern everywhere (the budgets-only ablation)."""
        layers = {phase: [LayerEntry(pattern, e.budget, e.modality, dict(e.signals)) for e in entries]
                  for phase, entries in self.layers.items()}
        return Strategy(model=dict(self.model), budget=self.budget, layers=layers, floor=self.floor,
                        candidates=list(self.candidates),
                        calibration=dict(self.calibration, ablation=f"one pattern: {pattern}")).validate()

    # ------------------------------------------------------------ checks
    def validate(self) -> "Strategy":
        if not isinstance(self.model, dict) or "config_hash" not in self.model:
            raise StrategyError("strategy has no model fingerprint (model.config_hash)")
        if not (isinstance(self.budget, (int, float)) and 0.0 < self.budget <= 1.0):
            raise StrategyError(f"strategy global budget must be in (0, 1], got {self.budget!r}")
        if not self.layers:
            raise StrategyError("strategy has no layers")
        unknown = set(self.layers) - set(PHASES)
        if unknown:
            raise StrategyError(f"unknown phase(s) {sorted(unknown)}; known: {', '.join(PHASES)}")
        if not (isinstance(self.floor, (int, float)) and self.floor >= 0):
            raise StrategyError(f"floor must be >= 0, got {self.floor!r}")
        counts = {phase: len(entries) for phase, entries in self.layers.items()}
        if len(set(counts.values())) != 1 or 0 in counts.values():
            raise StrategyError(f"every phase needs one entry per layer, got {counts}")
        expected_layers = self.model.get("num_layers")
        if expected_layers is not None and self.num_layers != expected_layers:
            raise StrategyError(
                f"strategy has {self.num_layers} layers but its model fingerprint says {expected_layers}")
        full_layer = 1.0 / self.num_layers
        for phase, entries in self.layers.items():
            for i, entry in enumerate(entries):
                where = f"layer {i} ({phase})"
                try:
                    key = normalize_policy_name(entry.pattern)
                except UnknownPolicyError as err:
                    raise StrategyError(f"{where}: {err}") from None
                if key == FULL_POLICY or key == COMBINED_POLICY:
                    raise StrategyError(f"{where}: pattern {entry.pattern!r} cannot be a layer pattern; "
                                        f"use an eviction policy ({', '.join(LAYER_POLICIES)})")
                entry.pattern = key
                if not (isinstance(entry.budget, (int, float)) and math.isfinite(entry.budget)):
                    raise StrategyError(f"{where}: budget must be a number, got {entry.budget!r}")
                if entry.budget < self.floor * (1 - 1e-9) or entry.budget <= 0:
                    raise StrategyError(f"{where}: budget {entry.budget:.6g} is below the floor {self.floor:.6g}")
                if entry.budget > full_layer * (1 + 1e-6):
                    raise StrategyError(
                        f"{where}: budget {entry.budget:.6g} exceeds a full layer (1/{self.num_layers} = {full_layer:.6g})")
                if entry.modality is not None:
                    bad = set(entry.modality) - set(MODALITIES)
                    if bad:
                        raise StrategyError(f"{where}: unknown modalities {sorted(bad)}; known: {', '.join(MODALITIES)}")
                    total = sum(entry.modality.values())
                    if any(v < 0 for v in entry.modality.values()) or abs(total - 1.0) > SUM_TOLERANCE:
                        raise StrategyError(f"{where}: modality shares must be >= 0 and sum to 1, got {entry.modality}")
            total = sum(e.budget for e in entries)
            if abs(total - self.budget) > SUM_TOLERANCE * self.budget:
                raise StrategyError(
                    f"{phase}: layer budgets sum to {total:.6g} but the global budget is {self.budget:.6g}")
        return self

    def check_fits(self, model) -> None:
        """Refuse a strategy calibrated for another model (same rule as gates)."""

        expected = get_adapter(model).fingerprint()
        if any(self.model.get(k) != expected.get(k) for k in ("family", "config_hash")):
            def brief(fp: dict) -> str:
                return (f"{fp.get('architecture')} ({fp.get('num_layers')} layers, {fp.get('num_kv_heads')} KV heads, "
                        f"hidden {fp.get('hidden_size')}, config {fp.get('config_hash')})")
            raise StrategyError(
                f"this strategy was calibrated for {brief(self.model)} but the model is {brief(expected)}; "
                "calibrate one for this model with `vlm-kv calibrate`")

    # ------------------------------------------------------------ files
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Strategy":
        if not isinstance(data, dict):
            raise StrategyError(f"a strategy is a JSON object, got {type(data).__name__}")
        version = data.get("version", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise StrategyError(f"strategy format version {version} is not supported (expected {FORMAT_VERSION})")
        try:
            layers = {phase: [LayerEntry(**e) for e in entries] for phase, entries in data["layers"].items()}
            fields = {k: v for k, v in data.items() if k != "layers"}
            return cls(layers=layers, **fields).validate()
        except (KeyError, TypeError, AttributeError) as err:
            raise StrategyError(f"malformed strategy: {err}") from None

    def save(self, path: str) -> None:
        self.validate()
        with open(path, "w") as fh:
            json.dump(self.to_dict(), fh, indent=1, sort_keys=True)
            fh.write("\n")

    @classmethod
    def load(cls, path: str, model=None) -> "Strategy":
        """Load and check a strategy file; with ``model``, refuse one calibrated for another model."""
        try:
            with open(path) as fh:
                data = json.load(fh)
        except FileNotFoundError:
            raise FileNotFoundError(f"strategy file not found: {path}") from None
        except json.JSONDecodeError as err:
            raise StrategyError(f"corrupt strategy file {path}: {err}") from None
        strategy = cls.from_dict(data)
        if model is not None:
            strategy.check_fits(model)
        return strategy


def uniform_strategy(model_fingerprint: dict[str, Any], budget: float, patterns: list[str] | dict[str, list[str]],
                     **kwargs: Any) -> Strategy:
    """Every layer keeps the same share; ``patterns``: one per layer, or phase -> one per layer."""
    if isinstance(patterns, list):
        patterns = {"prefill": patterns}
    layers = {phase: [LayerEntry(p, budget / len(ps)) for p in ps] for phase, ps in patterns.items()}
    return Strategy(model=dict(model_fingerprint), budget=budget, layers=layers, **kwargs).validate()


def resolve_strategy(strategy: "Strategy | str", model) -> Strategy:
    """A Strategy from an object or a path, checked against ``model``."""
    if isinstance(strategy, Strategy):
        strategy.validate()
        strategy.check_fits(model)
        return strategy
    if isinstance(strategy, str):
        return Strategy.load(strategy, model=model)
    raise TypeError(f"strategy must be a Strategy or a path to a strategy JSON, got {type(strategy).__name__}")
