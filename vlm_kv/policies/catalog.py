"""The policies a layer can run on its own: every eviction policy but polykv, which combines them
per layer from a strategy. Strategies and polykv read this catalog; the full registry
(``registry.py``) adds polykv to it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Callable

from vlm_kv.config import TierConfig

from vlm_kv.storage.allocation import Allocation, GlobalTopK, HeadAdaptive, Pyramid, Uniform
from vlm_kv.policies.base import Scorer
from vlm_kv.policies.h2o import H2O
from vlm_kv.policies.knorm import KNorm
from vlm_kv.policies.random_scorer import RandomScorer
from vlm_kv.policies.retention import RetentionScorer
from vlm_kv.policies.snapkv import SnapKV
from vlm_kv.policies.streaming_llm import StreamingLLM
from vlm_kv.policies.fastv import FastV
from vlm_kv.policies.rkv import RKV
from vlm_kv.policies.threshold import RetentionThreshold
from vlm_kv.policies.visionzip import VisionZip
from vlm_kv.policies.tova import TOVA
from vlm_kv.policies.kivi import KIVI2Scorer, QuantizeEverything
from vlm_kv.policies.kvzip import KVzipScorer
from vlm_kv.policies.qevict import QEvictScorer


@dataclass(frozen=True)
class PolicySpec:
    """Everything the library needs to know about a policy, in one place.

    ``gate_kind``: the kind of retention gates the policy scores with (None: no gates). Sinks
    and the protected recent window are properties of the scorer (``Scorer.sinks``,
    ``Scorer.protected_window``).
    """

    scorer: Callable[..., Scorer]
    allocation: Callable[..., Allocation]
    description: str
    gate_kind: str | None = None
    needs_strategy: bool = False  # built from a calibrated per-layer strategy (make_cache(strategy=))
    visual_only: bool = False     # evicts image/video entries only; text always stays
    tierable: bool = True         # its scores can rank windows for the FP / INT2 / evicted tiers
    default_tiers: dict | None = None  # the policy IS a tiered cache: TierConfig fields it uses
    tier_settings: dict | None = None  # TierConfig fields it gets with tiers="int2" (measured, docs/tiers.md)
    # scored by a pass over the model before the cache is filled (kvzip: vlm_kv.reconstruction.kvzip_prefill);
    # a plain forward into such a cache raises
    needs_reconstruction: bool = False

    @property
    def needs_gates(self) -> bool:
        return self.gate_kind is not None

    def tier_config(self, overrides: Mapping[str, Any]) -> TierConfig:
        """The tiers this policy runs with under ``tiers="int2"``: its own settings (``default_tiers``
        for a tiered policy, else ``tier_settings``) with ``overrides`` (TierConfig fields; None
        values ask for nothing) changed. The policy's FP / INT2 split gives way to the caller's: a
        fixed share holds at every budget, the value split routes whole windows (entry settings do
        not apply) and a budget schedule needs entry routing."""
        overrides = {k: v for k, v in overrides.items() if v is not None}
        known = {f.name for f in fields(TierConfig)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"unknown tier setting(s) {', '.join(unknown)}; TierConfig has {', '.join(sorted(known))}")
        splits = [f"{name}=" for name in ("int2_share", "int2_value", "int2_share_by_budget") if name in overrides]
        if len(splits) > 1:
            raise ValueError(f"{' and '.join(splits)} are ways to split FP / INT2: pass one of them")
        settings = dict(self.default_tiers if self.default_tiers is not None else self.tier_settings or {})
        if "int2_value" in overrides and "fp_unit" not in overrides:
            settings = {k: v for k, v in settings.items() if k not in ("fp_unit", "int2_share", "int2_share_by_budget")}
        if overrides.get("fp_unit", "token") != "token" or "int2_share" in overrides:
            settings.pop("int2_share_by_budget", None)
        settings.update(overrides)
        if settings.get("int2_share_by_budget") is not None:
            settings["int2_share_by_budget"] = tuple(settings["int2_share_by_budget"])
        config = TierConfig(**settings)
        self.check_tier_config(config)
        return config

    def check_tier_config(self, config: TierConfig) -> None:
        """What a tier configuration asks of this policy's scores."""
        if config.int2_value is not None:
            reduce = getattr(self.scorer, "window_reduce", None)
            if reduce not in ("sum", "logsumexp"):
                raise ValueError(f"int2_value= splits FP / INT2 by the value of windows, which needs additive window "
                                 f"scores; this policy's scorer reduces its windows by {reduce!r}: use int2_share= "
                                 "instead")


LAYER_POLICIES: dict[str, PolicySpec] = {
    "streaming_llm": PolicySpec(StreamingLLM, Uniform, "attention sinks + most recent tokens"),
    "h2o": PolicySpec(H2O, Uniform, "accumulated attention (heavy hitters) + recent window"),
    "tova": PolicySpec(TOVA, Uniform, "attention of the current query, head-averaged"),
    "snapkv": PolicySpec(SnapKV, Uniform, "observation-window attention, pooled"),
    "pyramidkv": PolicySpec(SnapKV, Pyramid, "SnapKV scores, capacities shrinking with depth"),
    "adakv": PolicySpec(SnapKV, HeadAdaptive, "SnapKV scores, heads of a layer share its budget"),
    "knorm": PolicySpec(KNorm, Uniform, "smallest key norms"),
    "random": PolicySpec(RandomScorer, Uniform, "random entries (a floor)"),
    "rkv": PolicySpec(RKV, Uniform, "recent-query attention importance minus key-similarity redundancy (R-KV)"),
    "fastv": PolicySpec(FastV, Uniform, "visual tokens ranked by the last token's attention from layer K on; text kept",
                        visual_only=True, tierable=False),
    "visionzip": PolicySpec(VisionZip, Uniform, "dominant visual tokens + one per contextual group; text kept",
                            visual_only=True, tierable=False),
    "trimkv": PolicySpec(RetentionScorer, Uniform, "learned retention gates, top-M per head", gate_kind="trimkv"),
    # tiered: FP per entry, INT2 share 0.5 at budgets up to 0.1 and 0.3 from 0.25 (session 7,
    # docs/tiers.md: lower KL than QEvict's whole windows with q 0.7 on pg84 and on the training
    # text at 0.05 / 0.1 / 0.25; q 0.5 best at 0.05, q 0.3 at 0.25 on both texts)
    "dbtrimkv": PolicySpec(RetentionScorer, GlobalTopK, "coupled retention gates, one global top-k over all layers and heads",
                           gate_kind="dbtrimkv",
                           tier_settings={"fp_unit": "token", "int2_share_by_budget": (0.1, 0.5, 0.25, 0.3)}),
    "dbtrimkv_threshold": PolicySpec(RetentionScorer, RetentionThreshold,
                                     "coupled retention gates, keep while score >= log alpha (no fixed budget)",
                                     gate_kind="dbtrimkv", tierable=False),
    "qevict": PolicySpec(QEvictScorer, Uniform, "H2O window mass routing windows to FP / INT2 / evicted (QEvict)",
                         # the paper's recipe is key_grid="fp16", int2_share=0.7, basis="channel"; with the compact
                         # grid a larger INT2 share wins on four pg84 passages at 0.05 and 0.1 (docs/tiers.md, session 8)
                         default_tiers={"int2_share": 0.9}),
    "kvzip": PolicySpec(KVzipScorer, GlobalTopK, "most attention an entry gets while the model repeats its context "
                        "(query-agnostic, KVzip); needs vlm_kv.reconstruction.kvzip_prefill", tierable=False,
                        needs_reconstruction=True),
    "kivi2": PolicySpec(KIVI2Scorer, QuantizeEverything,
                        "everything but sinks and a recent residual in INT2, nothing evicted (KIVI-2)",
                        default_tiers={"quantize_all": True, "window": 32, "key_grid": "fp16",
                                       "basis": "channel"}),  # KIVI's fp16 grid, channel basis
}

FULL_POLICY = "full"
COMBINED_POLICY = "polykv"  # per-layer patterns from a strategy: registry.py
# every policy name, in the order they are listed
POLICY_NAMES = (*list(LAYER_POLICIES)[: list(LAYER_POLICIES).index("dbtrimkv_threshold") + 1], COMBINED_POLICY,
                *list(LAYER_POLICIES)[list(LAYER_POLICIES).index("dbtrimkv_threshold") + 1 :])


class UnknownPolicyError(ValueError):
    pass


def normalize_policy_name(name: str) -> str:
    """The registry key for a user-given policy name: "DBTrimKV" -> "dbtrimkv", "Streaming-LLM" -> "streaming_llm"."""
    if not isinstance(name, str):
        raise UnknownPolicyError(f"policy must be a name, got {type(name).__name__}")
    key = name.strip().lower().replace("-", "_")
    if key != FULL_POLICY and key not in POLICY_NAMES:
        raise UnknownPolicyError(f"unknown policy {name!r}; known: {', '.join([FULL_POLICY, *POLICY_NAMES])}")
    return key


def layer_policy_spec(name: str) -> PolicySpec:
    """The spec of a policy a single layer can run (any but full and polykv)."""
    key = normalize_policy_name(name)
    if key not in LAYER_POLICIES:
        raise UnknownPolicyError(f"policy {name!r} cannot run as one layer's pattern")
    return LAYER_POLICIES[key]
