"""PolyKV: every layer evicts with its own pattern and keeps its own share of the budget.

Eviction as a per-layer design space (PolyKV): for each layer l and phase (prefill, decode) a
pattern r[l, phase] (any registered policy) and a budget b[l, phase], the budgets summing to the
global budget, all read from a ``Strategy`` calibrated offline (``vlm-kv calibrate``).

How the pieces plug into the core:

* ``PolyKV.for_layer(l)`` is what layer l observes with during attention: it feeds every
  pattern the layer uses in either phase (so a decode-phase H2O has the prefill's attention);
* ``PolyKV.for_phase(phase).for_layer(l)`` is what an eviction step scores layer l with;
* ``PolyKVAllocation.for_step(phase, tokens)`` splits the step's ``L * cap`` tokens per head
  between layers by their shares (capped at what a layer holds, the surplus going to the other
  layers), so the whole cache holds the global budget after every eviction step; within a layer
  the pattern's own allocation (uniform, or AdaKV's head-adaptive) picks the entries.

Gated patterns (trimkv, dbtrimkv) score with their retention gates, each layer taking its own
top-k: DBTrimKV's single global top-k over all layers is replaced by the strategy's shares.

Per-modality shares (``LayerEntry.modality``, text / image / video summing to 1) split a layer's
budget inside the layer: each modality's best entries up to its share rank above every entry
beyond its share, so the surplus is evicted first (by score); a modality holding fewer entries
than its share passes the rest on to the others; the protected sinks and recent window count in
their own modality's share. Quotas are per head for uniform patterns and over the layer's heads
for head-adaptive ones (AdaKV). Done in the scorer, so no core hook is needed.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from vlm_kv.models.adapters import MODALITIES
from vlm_kv.policies.base import ScoreContext, Scorer, protected_counts
from vlm_kv.policies.catalog import layer_policy_spec
from vlm_kv.policies.strategy import PHASES, Strategy, StrategyError, resolve_strategy
from vlm_kv.storage.allocation import Allocation, HeadAdaptive, Uniform
from vlm_kv.storage.ordering import descending_order


def split_capacity(total: int, shares: list[float], limit: int) -> list[int]:
    """Integer tokens per head for each layer: proportional to ``shares``, none above ``limit``,
    summing to ``min(total, limit * layers)``. A layer that cannot use its share (it holds fewer
    tokens) passes the surplus to the others in proportion to theirs; remainders go to the
    largest fractional parts (ties to the lower layer), so the result is deterministic."""
    n = len(shares)
    total = max(0, min(int(total), limit * n))
    caps = [0] * n
    active = [i for i in range(n) if shares[i] > 0]
    left = total
    while active:
        weight = sum(shares[i] for i in active)
        ideal = {i: left * shares[i] / weight for i in active}
        full = [i for i in active if ideal[i] >= limit]
        if not full:
            floors = {i: int(ideal[i]) for i in active}
            spare = left - sum(floors.values())
            order = sorted(active, key=lambda i: (-(ideal[i] - floors[i]), i))
            for i in order[:spare]:
                floors[i] += 1
            for i in active:
                caps[i] = min(limit, floors[i])
            break
        for i in full:
            caps[i] = limit
            left -= limit
        active = [i for i in active if i not in full]
    return caps


def modality_quotas(counts: torch.Tensor, shares: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """Entries each modality may keep before its surplus is evicted first: ``total`` split by
    ``shares``; a modality holding fewer entries than its share passes the rest to the others
    in proportion to theirs (water-filling). counts: [..., M], shares: [M], total: [...];
    returns [..., M] (floored)."""
    counts = counts.double()
    quota = torch.zeros_like(counts)
    active = (counts > 0) & (shares > 0)
    left = torch.minimum(total.double(), counts.sum(-1))
    for _ in range(counts.shape[-1]):
        weight = torch.where(active, shares.double().expand_as(counts), torch.zeros_like(counts))
        wsum = weight.sum(-1, keepdim=True)
        ideal = torch.where(wsum > 0, left.unsqueeze(-1) * weight / wsum.clamp_min(1e-300), torch.zeros_like(counts))
        room = counts - quota
        full = active & (ideal >= room)
        if not bool(full.any()):
            quota = quota + ideal
            break
        quota = torch.where(full, counts, quota)
        left = left - torch.where(full, room, torch.zeros_like(room)).sum(-1)
        active = active & ~full
    return torch.floor(quota + 1e-9).long()


def split_by_modality(scores: torch.Tensor, modality: torch.Tensor, valid: torch.Tensor, shares: dict[str, float],
                      capacity: torch.Tensor, per_head: bool) -> torch.Tensor:
    """Scores reordered so that, within a layer, the entries of a modality beyond its share of
    the layer's capacity rank below every entry within its share (each group keeping its own
    order by score): the allocation's top-k then evicts the surplus first.

    scores, modality, valid: [B, H, L]; capacity: [B] entries per head. ``per_head``: quotas per
    head (uniform allocations) or over the whole layer (head-adaptive allocations)."""

    b, h, length = scores.shape
    present = torch.unique(modality[valid]) if bool(valid.any()) else torch.empty(0)
    if present.numel() <= 1:
        return scores  # one modality: its share is the whole layer
    share = torch.tensor([float(shares.get(m, 0.0)) for m in MODALITIES], dtype=torch.float64)
    if per_head:
        flat_s, flat_m, flat_v, total = scores, modality, valid, capacity.view(-1, 1).expand(b, h)
    else:
        flat_s, flat_m, flat_v = scores.reshape(b, 1, -1), modality.reshape(b, 1, -1), valid.reshape(b, 1, -1)
        total = (capacity * h).view(-1, 1)
    counts = torch.stack([((flat_m == code) & flat_v).sum(-1) for code in range(len(MODALITIES))], dim=-1)
    quotas = modality_quotas(counts, share, total)
    within = torch.zeros_like(flat_v)
    for code in range(len(MODALITIES)):
        mine = (flat_m == code) & flat_v
        if not bool(mine.any()):
            continue
        pool = flat_s.float().masked_fill(~mine, float("-inf"))
        order = descending_order(pool)
        ranks = torch.empty_like(order)
        ranks.scatter_(-1, order, torch.arange(pool.shape[-1]).expand_as(order))
        within |= mine & (ranks < quotas[..., code : code + 1])
    # two tiers by rank over the whole layer: in-share entries above every surplus entry
    flat = scores.float().reshape(b, -1)
    order = torch.argsort(flat, dim=-1, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(flat.shape[-1]).expand_as(order))
    tiered = ranks.double() + within.reshape(b, -1).double() * flat.shape[-1]
    tiered = torch.where(torch.isneginf(flat), torch.full_like(tiered, float("-inf")), tiered)
    return tiered.reshape(b, h, length).float()


@dataclass
class _Pattern(Scorer):
    """One layer's pattern at scoring time: it sees only the most recent queries it asked for
    (the layer remembers the most any of its patterns needs, in ring order); with modality
    shares it ranks each modality's surplus below the entries within their shares."""

    inner: Scorer = None
    modality: dict[str, float] | None = None
    per_head: bool = True

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.inner.name

    @property
    def sinks(self) -> int:
        return self.inner.sinks

    def protected_window(self, capacity: int) -> int:
        return self.inner.protected_window(capacity)

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        want = self.inner.query_window
        pos = ctx.window_positions
        if want > 0 and pos is not None and pos.numel() > want:
            latest = torch.topk(pos, want).indices
            ctx = dataclasses.replace(ctx, window_queries=ctx.window_queries.index_select(2, latest),
                                      window_positions=pos.index_select(0, latest))
        scores = self.inner.score(ctx)
        if self.modality is None:
            return scores
        if ctx.view.modality is None:
            raise RuntimeError("modality shares need the entries' modality in the scoring view")
        # the entries the evictor will protect (sinks, recent window) are kept whatever their
        # modality: they count in their modality's share first
        view = ctx.view
        first = view.positions.masked_fill(~view.valid, torch.iinfo(view.positions.dtype).max).flatten(1).min(1).values
        pairs = [protected_counts(self.inner, int(c)) for c in ctx.capacity.tolist()]
        sinks = torch.tensor([p[0] for p in pairs], device=first.device)
        windows = torch.tensor([p[1] for p in pairs], device=first.device)
        protected = (view.positions - first.view(-1, 1, 1)) < sinks.view(-1, 1, 1)
        protected |= view.positions >= (ctx.seen - windows).view(-1, 1, 1)
        scores = torch.where(protected & view.valid, torch.full_like(scores.float(), float("inf")), scores.float())
        return split_by_modality(scores, view.modality, view.valid, self.modality, ctx.capacity, self.per_head)


class _LayerObserver(Scorer):
    """Layer l during attention: feeds the observations of every pattern it uses."""

    def __init__(self, patterns: list[Scorer]) -> None:
        self.patterns = patterns
        received = [p.uses_received_attention for p in patterns if p.observes]
        if any(received) and not all(received):
            raise ValueError("a layer cannot mix patterns that observe decode attention in different ways: "
                             f"{[p.name for p in patterns]}")
        self._uses_received = any(received)

    @property
    def state_names(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(dict.fromkeys(n for p in self.patterns for n in p.state_names))

    @property
    def query_window(self) -> int:
        return max(p.query_window for p in self.patterns)

    @property
    def uses_received_attention(self) -> bool:  # type: ignore[override]
        return self._uses_received

    @property
    def observes(self) -> bool:
        return any(p.observes for p in self.patterns)

    def observe(self, store, query, view, query_positions, scaling) -> None:
        for p in self.patterns:
            if p.observes:
                p.observe(store, query, view, query_positions, scaling)

    def observe_received(self, store, body, tail) -> None:
        for p in self.patterns:
            if p.uses_received_attention:
                p.observe_received(store, body, tail)


class _PhaseScorer(Scorer):
    """What an eviction step after a ``phase`` forward scores each layer with."""

    def __init__(self, owner: "PolyKV", phase: str) -> None:
        self.owner = owner
        self.phase = phase

    @property
    def state_names(self) -> tuple[str, ...]:  # type: ignore[override]
        return self.owner.state_names

    def for_layer(self, layer_idx: int) -> Scorer:
        return self.owner.scoring[self.phase][self.owner.check_layer(layer_idx)]


@dataclass
class PolyKV(Scorer):
    """Per-layer, per-phase patterns from a calibrated ``strategy`` (PolyKV; our calibration)."""

    name: ClassVar[str] = "polykv"
    strategy: Strategy = None
    scorers: dict[str, Scorer] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.strategy, Strategy):
            raise ValueError("policy 'polykv' needs a strategy: make_cache(..., policy='polykv', strategy=PATH) "
                             "(calibrate one with `vlm-kv calibrate`)")
        self.strategy.validate()
        self.num_layers = self.strategy.num_layers
        # one scorer instance per (layer, pattern): a pattern used in both phases observes once
        self.scoring: dict[str, list[Scorer]] = {}
        per_layer: list[dict[str, Scorer]] = [{} for _ in range(self.num_layers)]
        for phase in PHASES:
            row = []
            for i, entry in enumerate(self.strategy.phase(phase)):
                if entry.pattern not in per_layer[i]:
                    per_layer[i][entry.pattern] = layer_policy_spec(entry.pattern).scorer()
                spec = layer_policy_spec(entry.pattern)
                per_head = not isinstance(spec.allocation(), HeadAdaptive)
                row.append(_Pattern(inner=per_layer[i][entry.pattern], modality=entry.modality, per_head=per_head))
            self.scoring[phase] = row
        self.observers = [_LayerObserver(list(d.values())) for d in per_layer]
        self._state_names = tuple(dict.fromkeys(n for o in self.observers for n in o.state_names))

    @property
    def state_names(self) -> tuple[str, ...]:  # type: ignore[override]
        return self._state_names

    @property
    def query_window(self) -> int:
        return max(o.query_window for o in self.observers)

    @property
    def sinks(self) -> int:
        return max(p.sinks for row in self.scoring.values() for p in row)

    def check_layer(self, layer_idx: int) -> int:
        if not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"the strategy has {self.num_layers} layers; the model has a layer {layer_idx}")
        return layer_idx

    def for_layer(self, layer_idx: int) -> Scorer:
        return self.observers[self.check_layer(layer_idx)]

    def for_phase(self, phase: str) -> Scorer:
        return _PhaseScorer(self, phase)


class _LayerShare(Allocation):
    """Layer l's capacity this step and its pattern's rule for choosing entries among heads."""

    def __init__(self, step: "_StepAllocation", layer_idx: int, inner: Allocation) -> None:
        self.step = step
        self.layer_idx = layer_idx
        self.inner = inner

    def layer_capacity(self, layer_idx: int, num_layers: int, cap: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        return self.step.capacities(cap, num_layers)[:, self.layer_idx]

    def keep_layer(self, scores: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
        return self.inner.keep_layer(scores, cap)


class _StepAllocation(Allocation):
    def __init__(self, owner: "PolyKVAllocation", phase: str, valid_tokens: torch.Tensor) -> None:
        self.owner = owner
        self.phase = phase
        self.limits = [int(n) for n in valid_tokens.tolist()]
        self._caps: tuple[tuple[int, ...], torch.Tensor] | None = None

    def capacities(self, cap: torch.Tensor, num_layers: int) -> torch.Tensor:
        """[B, L] tokens per head of every layer; the sum over layers is at most L * cap."""
        shares = self.owner.shares[self.phase]
        if num_layers != len(shares):
            raise ValueError(f"the strategy has {len(shares)} layers but the eviction step sees {num_layers}")
        key = tuple(int(c) for c in cap.tolist())
        if self._caps is None or self._caps[0] != key:
            rows = [split_capacity(c * num_layers, shares, limit) for c, limit in zip(key, self.limits)]
            self._caps = (key, torch.tensor(rows, dtype=torch.long, device=cap.device))
        return self._caps[1]

    def for_layer(self, layer_idx: int) -> Allocation:
        return _LayerShare(self, layer_idx, self.owner.inner[self.phase][layer_idx])


@dataclass
class PolyKVAllocation(Allocation):
    """Per-layer budget shares from a strategy; each layer chooses among its heads with its
    pattern's own allocation (a global allocation becomes a per-layer uniform one)."""

    name: ClassVar[str] = "polykv"
    strategy: Strategy = None

    def __post_init__(self) -> None:
        if not isinstance(self.strategy, Strategy):
            raise ValueError("policy 'polykv' needs a strategy: make_cache(..., policy='polykv', strategy=PATH)")
        self.shares = {phase: self.strategy.relative_shares(phase) for phase in PHASES}
        self.inner: dict[str, list[Allocation]] = {}
        for phase in PHASES:
            row = []
            for entry in self.strategy.phase(phase):
                alloc = layer_policy_spec(entry.pattern).allocation()
                row.append(Uniform() if alloc.is_global else alloc)
            self.inner[phase] = row

    def for_step(self, phase: str, valid_tokens: torch.Tensor) -> Allocation:
        return _StepAllocation(self, phase, valid_tokens)

    def keep_layer(self, scores: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("PolyKVAllocation chooses per step: the evictor must call for_step first")


STRATEGIES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "strategies")


def default_strategy_for(model) -> str | None:
    """Path of a strategy shipped in the package that fits ``model``, or None."""

    for path in sorted(glob.glob(os.path.join(STRATEGIES_DIR, "*.json"))):
        try:
            Strategy.load(path, model=model)
        except StrategyError:
            continue
        return os.path.normpath(path)
    return None


def strategy_kwargs(model, strategy: "Strategy | str | None", scorer_kwargs: dict | None,
                    allocation_kwargs: dict | None) -> tuple[dict, dict, str | None]:
    """Scorer and allocation keyword arguments for ``polykv`` on ``model``, and the gate kind its
    patterns need (None: no gates)."""

    if strategy is None:
        strategy = default_strategy_for(model)
        if strategy is None:
            raise ValueError("policy 'polykv' needs a strategy for this model: pass strategy=PATH "
                             "(calibrate one with `vlm-kv calibrate`)")
    if scorer_kwargs or allocation_kwargs:
        raise ValueError("policy 'polykv' takes its patterns and shares from the strategy, not scorer_kwargs/allocation_kwargs")
    resolved = resolve_strategy(strategy, model)
    kinds = {layer_policy_spec(p).gate_kind for p in resolved.patterns()} - {None}
    if len(kinds) > 1:
        raise ValueError(f"the strategy mixes patterns needing different gates ({sorted(kinds)}); one gate kind per cache")
    return {"strategy": resolved}, {"strategy": resolved}, (kinds.pop() if kinds else None)
