"""Diagnostics of eviction and tiering decisions, measured against the full cache's attention.

Teacher-forced on a text: prefill ``context`` tokens, then feed ``continuation`` tokens one at a
time, once with a plain full cache (recording each decode query's attention over every earlier
position, per KV head) and once with the compressed cache (recording, at every eviction /
routing event, which windows of ``window`` tokens each layer and KV head still holds, and
which it holds in full precision). From these records:

- Future Missed Mass (FMM): the share of the next ``horizon`` decode steps' full-cache
  attention mass, over the history that existed at the event, that falls on windows the
  compressed cache can no longer reach.
- Selection churn: 1 - Jaccard of the accessible window sets at consecutive events.
- Global LIR (latent importance reactivation): among runs where a window stays out of full
  precision for at least ``lir_m`` consecutive events, the share back in full precision
  within ``horizon`` decode steps (right-censored runs excluded).

The computations are pure functions over recorded events (``future_missed_mass``,
``selection_churn``, ``latent_reactivation``); ``diagnose`` runs a model and applies them.
Definitions and measured numbers: docs/diagnostics.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from vlm_kv.api import cache_kwarg, make_cache
from vlm_kv.cache.cache import CompressedCache
from vlm_kv.cache.hooks import eager_attention
from vlm_kv.config import TierConfig
from vlm_kv.eval.fidelity import text_tokens

# Default runs a window must stay out of full precision before it counts as "latent": one
# event out is often a swap at the top-n boundary; two consecutive events (with the default
# evict_every 16, at least 16 decode steps apart) is a decision that held.
DEFAULT_LIR_M = 2


@dataclass
class RoutingEvent:
    """What the compressed cache held right after one eviction / routing step.

    step: decode steps fed before this event (0 = right after the prefill).
    seen: positions that existed at the event (prefill length + step).
    accessible: [layers, kv_heads, num_windows] bool, the layer/head holds at least one entry
        of the window (any tier).
    selected: same shape, the layer/head holds at least one entry of the window in full
        precision (tier 0).
    held_tokens: optional [layers, kv_heads, positions] bool, the positions held (any tier), for
        the token-level missed mass (a window with one token left is reachable, most of its
        mass is not).
    """

    step: int
    seen: int
    accessible: torch.Tensor
    selected: torch.Tensor
    held_tokens: torch.Tensor | None = None


def window_sets(
    positions: torch.Tensor, tiers: torch.Tensor, window: int, num_windows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accessible and full-precision window sets of one layer from its held entries.

    positions: [kv_heads, L] original positions, -1 for empty slots; tiers: [kv_heads, L]
    (0 = full precision). Returns two [kv_heads, num_windows] bool tensors.
    """
    if positions.shape != tiers.shape or positions.dim() != 2:
        raise ValueError(f"positions {tuple(positions.shape)} and tiers {tuple(tiers.shape)} must both be [kv_heads, L]")
    if window < 1:
        raise ValueError(f"window must be >= 1 token, got {window}")
    valid = positions >= 0
    ids = torch.div(positions.clamp(min=0), window, rounding_mode="floor")
    if bool((ids[valid] >= num_windows).any()):
        raise ValueError(f"a held position lies past the last of {num_windows} windows of {window} tokens")
    dummy = torch.full_like(ids, num_windows)  # a spare column that absorbs empty slots
    heads = positions.shape[0]

    def mark(mask: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(heads, num_windows + 1, dtype=torch.bool, device=positions.device)
        out.scatter_(1, torch.where(mask, ids, dummy), True)
        return out[:, :num_windows]

    return mark(valid), mark(valid & (tiers == 0))


def held_token_mask(positions: torch.Tensor, num_positions: int) -> torch.Tensor:
    """[kv_heads, num_positions] bool: which positions a layer holds, from [kv_heads, L] (-1 empty)."""
    valid = positions >= 0
    if bool((positions >= num_positions).any()):
        raise ValueError(f"a held position lies past the {num_positions} positions of the text")
    out = torch.zeros(positions.shape[0], num_positions + 1, dtype=torch.bool, device=positions.device)
    out.scatter_(1, torch.where(valid, positions, torch.full_like(positions, num_positions)), True)
    return out[:, :num_positions]


def _check_events(events: list[RoutingEvent]) -> None:
    for before, after in zip(events, events[1:]):
        if after.step < before.step or after.seen < before.seen:
            raise ValueError(f"events out of order: step {before.step} then {after.step}")


def future_missed_mass(
    attention: torch.Tensor, events: list[RoutingEvent], window: int, horizon: int
) -> list[dict[str, Any]]:
    """FMM of each event that has at least one decode step after it.

    attention: [steps, layers, kv_heads, positions] full-cache attention of decode step s's
        query (at position prefill + s) over every position, zero past its own.
    Returns one dict per event: ``event`` (its index), ``step``, ``future_steps`` (min(horizon,
    steps left)) and
    ``fmm`` ([layers, kv_heads] float tensor): future mass on windows that existed at the
    event and are not accessible, over the future mass on all windows that existed at it.
    Only positions that existed at the event count (a window still filling counts with its
    existing tokens only).
    """
    if horizon < 1:
        raise ValueError(f"horizon must be >= 1 decode step, got {horizon}")
    _check_events(events)
    steps = attention.shape[0]
    out = []
    for index, event in enumerate(events):
        future = min(horizon, steps - event.step)
        if future <= 0:
            continue
        if event.seen > attention.shape[-1]:
            raise ValueError(f"event at step {event.step} saw {event.seen} positions, attention covers {attention.shape[-1]}")
        mass = attention[event.step : event.step + future, ..., : event.seen].float().sum(0)  # [layers, heads, seen]
        n_windows = math.ceil(event.seen / window)
        ids = torch.arange(event.seen, device=mass.device) // window
        per_window = torch.zeros(*mass.shape[:2], n_windows, dtype=mass.dtype, device=mass.device)
        per_window.index_add_(2, ids, mass)
        reachable = event.accessible[..., :n_windows]
        missed = (per_window * ~reachable).sum(-1)
        total = per_window.sum(-1)
        if bool((total <= 0).any()):
            raise ValueError(f"no attention mass on the history at step {event.step}: the attention record is empty")
        out.append({"event": index, "step": event.step, "future_steps": future, "fmm": missed / total})
    return out


def selection_churn(events: list[RoutingEvent], window: int) -> list[dict[str, Any]]:
    """1 - Jaccard(accessible windows) between each event and the one before, per (layer, head).

    Only windows complete (all ``window`` tokens existed) at the earlier event are compared, so
    windows born in between do not count as churn; two empty sets have churn 0.
    Returns one dict per consecutive pair: ``event`` and ``step`` (the later event's) and
    ``churn`` ([layers, kv_heads]).
    """
    _check_events(events)
    out = []
    for index, (before, after) in enumerate(zip(events, events[1:]), start=1):
        complete = before.seen // window
        a = before.accessible[..., :complete]
        b = after.accessible[..., :complete]
        inter = (a & b).sum(-1).float()
        union = (a | b).sum(-1).float()
        jaccard = torch.where(union > 0, inter / union.clamp(min=1), torch.ones_like(union))
        out.append({"event": index, "step": after.step, "churn": 1.0 - jaccard})
    return out


@dataclass
class ReactivationCounts:
    """Runs of a window out of full precision for >= m events, and what became of them."""

    runs: int = 0          # qualifying runs whose horizon was observed (the denominator)
    reactivated: int = 0   # of those, back in full precision within the horizon
    censored: int = 0      # qualifying runs whose horizon reached past the end, never reselected

    @property
    def lir(self) -> float:
        return self.reactivated / self.runs if self.runs else float("nan")


def latent_reactivation(
    events: list[RoutingEvent], window: int, m: int, horizon: int, total_steps: int
) -> ReactivationCounts:
    """Global LIR over every (layer, kv head, window).

    A run starts at the first event a complete window is not in full precision and lasts while it
    stays out; it qualifies at its ``m``-th consecutive event out (at decode step q). It counts
    as reactivated if an event at a step in (q, q + horizon] has it back in full precision, as
    not reactivated if the horizon passes without that, and as censored (excluded) if it was
    never reselected and q + horizon lies past ``total_steps``, the last decode step fed.
    Each run counts at most once.
    """
    if m < 1:
        raise ValueError(f"lir m must be >= 1 event, got {m}")
    if horizon < 1:
        raise ValueError(f"horizon must be >= 1 decode step, got {horizon}")
    _check_events(events)
    counts = ReactivationCounts()
    if not events:
        return counts
    shape = events[0].selected.shape
    run = torch.zeros(shape, dtype=torch.long)
    pending = torch.full(shape, -1, dtype=torch.long)   # qualifying step of an open run, -1 none
    resolved = torch.zeros(shape, dtype=torch.bool)     # this run already counted
    window_ids = torch.arange(shape[-1])
    for event in events:
        if event.selected.shape != shape:
            raise ValueError(f"event at step {event.step} has window sets {tuple(event.selected.shape)}, expected {tuple(shape)}")
        complete = (window_ids < event.seen // window).expand(shape)
        selected = event.selected.cpu() & complete
        out = complete & ~event.selected.cpu()
        waiting = pending >= 0
        back = waiting & selected & (event.step - pending <= horizon)
        expired = waiting & ~back & (event.step - pending > horizon)
        counts.reactivated += int(back.sum())
        counts.runs += int(back.sum()) + int(expired.sum())
        pending[back | expired] = -1
        resolved |= back | expired
        run = torch.where(selected, torch.zeros_like(run), run + out.long())
        resolved &= ~selected
        qualifies = out & (run >= m) & ~resolved & (pending < 0)
        pending[qualifies] = event.step
    open_runs = pending >= 0
    observed = open_runs & (pending + horizon <= total_steps)
    counts.runs += int(observed.sum())
    counts.censored += int((open_runs & ~observed).sum())
    return counts


# ----------------------------------------------------------------------------- runner


@dataclass
class DiagnosticsResult:
    params: dict[str, Any]
    events: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _nan_to_none(x: float) -> float | None:
    return None if isinstance(x, float) and math.isnan(x) else x


def summarize(
    events: list[RoutingEvent],
    attention: torch.Tensor,
    window: int,
    horizon: int,
    lir_m: int,
    params: dict[str, Any] | None = None,
) -> DiagnosticsResult:
    """Per-event lists and summary means of FMM, churn and LIR for recorded events.

    The FMM summary averages events whose whole horizon lies inside the continuation (events
    with a shorter future are listed with their ``future_steps`` but not averaged).
    """
    total_steps = attention.shape[0]
    fmm = {row["event"]: row for row in future_missed_mass(attention, events, window, horizon)}
    tokens = {}
    if events and all(e.held_tokens is not None for e in events):
        as_windows_of_one = [RoutingEvent(e.step, e.seen, e.held_tokens, e.held_tokens) for e in events]
        tokens = {row["event"]: row["fmm"] for row in future_missed_mass(attention, as_windows_of_one, 1, horizon)}
    churn = {row["event"]: row["churn"] for row in selection_churn(events, window)}
    lir = latent_reactivation(events, window, lir_m, horizon, total_steps)
    rows = []
    held_per_layer: list[torch.Tensor] = []  # share of the existing positions each layer holds, per event
    for i, event in enumerate(events):
        complete = event.seen // window
        row: dict[str, Any] = {
            "step": event.step,
            "seen": event.seen,
            "accessible_share": float(event.accessible[..., :complete].float().mean()) if complete else None,
            "fp_share": float(event.selected[..., :complete].float().mean()) if complete else None,
            "held_share": None, "future_steps": 0, "fmm": None, "fmm_per_layer": None, "fmm_tokens": None,
            "churn": None,
        }
        if event.held_tokens is not None:
            held_per_layer.append(event.held_tokens[..., : event.seen].float().mean(dim=(1, 2)))
            row["held_share"] = float(held_per_layer[-1].mean())
        if i in fmm:
            f = fmm[i]
            row.update(future_steps=f["future_steps"], fmm=float(f["fmm"].mean()),
                       fmm_per_layer=[float(x) for x in f["fmm"].mean(-1)])
        if i in tokens:
            row["fmm_tokens"] = float(tokens[i].mean())
        if i in churn:
            row["churn"] = float(churn[i].mean())
        rows.append(row)
    full = [r for r in rows if r["fmm"] is not None and r["future_steps"] == horizon]
    churned = [r["churn"] for r in rows if r["churn"] is not None]
    per_layer = None
    if full:
        per_layer = [sum(r["fmm_per_layer"][i] for r in full) / len(full) for i in range(len(full[0]["fmm_per_layer"]))]
    summary = {
        "events": len(events),
        "fmm_events": len(full),
        "fmm_mean": sum(r["fmm"] for r in full) / len(full) if full else None,
        "fmm_per_layer": per_layer,
        "fmm_tokens_mean": sum(r["fmm_tokens"] for r in full) / len(full) if full and full[0]["fmm_tokens"] is not None else None,
        "churn_mean": sum(churned) / len(churned) if churned else None,
        "held_share_per_layer": [float(x) for x in torch.stack(held_per_layer).mean(0)] if held_per_layer else None,
        "lir": _nan_to_none(lir.lir),
        "lir_runs": lir.runs,
        "lir_reactivated": lir.reactivated,
        "lir_censored": lir.censored,
    }
    return DiagnosticsResult(params=dict(params or {}), events=rows, summary=summary)


@torch.no_grad()
def reference_attention(model, ids: torch.Tensor, context: int, progress: bool = False) -> torch.Tensor:
    """Full-cache attention of each decode query over every position, per KV head.

    Prefills ``ids[:, :context]`` into a DynamicCache, then feeds the rest one token at a time
    with eager attention and ``output_attentions``. Returns [steps, layers, kv_heads, positions]
    float16 (steps = ids.shape[1] - context), each query head's probabilities averaged over its
    GQA group; step s's row is zero past position context + s.
    """

    if ids.shape[0] != 1:
        raise ValueError(f"diagnostics run one sequence, got a batch of {ids.shape[0]}")
    with eager_attention(model) as adapter:
        cache = DynamicCache(config=model.config)
        arg = {cache_kwarg(model): cache}
        model(input_ids=ids[:, :context], **arg, use_cache=True)
        steps, total = ids.shape[1] - context, ids.shape[1]
        kv = adapter.num_kv_heads
        out = torch.zeros(steps, adapter.num_layers, kv, total, dtype=torch.float16)
        for s in tqdm(range(steps), desc="full cache (attention)", disable=not progress, leave=False):
            attn = model(input_ids=ids[:, context + s : context + s + 1], **arg, use_cache=True,
                         output_attentions=True).attentions
            if attn is None or len(attn) != adapter.num_layers:
                raise RuntimeError("the model returned no attention probabilities for every layer (output_attentions)")
            for layer, probs in enumerate(attn):  # [1, Hq, 1, seen]
                grouped = probs[0, :, -1].float().reshape(kv, -1, probs.shape[-1]).mean(1)
                out[s, layer, :, : probs.shape[-1]] = grouped.to(torch.float16)
    return out


def build_cache(model, policy: str, budget: float, window: int, **cache_kwargs):
    """``make_cache`` for a diagnosed run; a tiered cache routes by the same ``window`` the
    diagnostics count in (set in its ``tiers=``). Refuses a policy that gives no compressed cache."""

    tiers = cache_kwargs.get("tiers")
    if isinstance(tiers, TierConfig):
        cache_kwargs["tiers"] = dataclasses.replace(tiers, window=window)
    elif tiers is not None and tiers != "none":
        cache_kwargs["tiers"] = {**({} if tiers == "int2" else dict(tiers)), "window": window}
    cache = make_cache(model, policy=policy, budget=budget, **cache_kwargs)
    if not isinstance(cache, CompressedCache):
        raise ValueError(f"policy {policy!r} gives a {type(cache).__name__}, not a compressed cache: nothing to diagnose")
    return cache


def cache_params(cache_kwargs: dict) -> dict:
    """The cache settings of a diagnosed run as plain JSON fields: ``tiers`` ("int2" or None), the
    tier fields changed, and the CacheOptions fields changed."""
    tiers = cache_kwargs.get("tiers")
    out: dict = {"tiers": None if tiers in (None, "none") else "int2"}
    if isinstance(tiers, TierConfig):
        out.update(dataclasses.asdict(tiers))
    elif isinstance(tiers, dict):
        out.update(tiers)
    options = cache_kwargs.get("options")
    if options is not None:
        out.update({f.name: getattr(options, f.name) for f in dataclasses.fields(options)
                    if getattr(options, f.name) != f.default})
    out.update({k: v for k, v in cache_kwargs.items()
                if k not in ("tiers", "options") and isinstance(v, (int, float, str, bool))})
    return out


def listen_for_events(cache, context: int, num_positions: int, window: int) -> list[RoutingEvent]:
    """Register a listener on ``cache`` that appends a RoutingEvent after every eviction step
    (sequence 0 of the batch); returns the list it fills. ``context`` = the prefill length, so
    an event's step is the tokens the cache has seen minus it."""
    num_windows = math.ceil(num_positions / window)
    events: list[RoutingEvent] = []

    def listen(c) -> None:
        accessible, selected, held = [], [], []
        for layer in c.layers:
            positions, tier = layer.held_positions()
            a, s = window_sets(positions[0], tier[0], window, num_windows)
            accessible.append(a)
            selected.append(s)
            held.append(held_token_mask(positions[0], num_positions))
        seen = int(c.ledger.seen)
        events.append(RoutingEvent(step=seen - context, seen=seen, accessible=torch.stack(accessible).cpu(),
                                   selected=torch.stack(selected).cpu(), held_tokens=torch.stack(held).cpu()))

    cache.eviction_listeners.append(listen)
    return events


@torch.no_grad()
def record_events(
    model, ids: torch.Tensor, context: int, policy: str, budget: float, window: int,
    progress: bool = False, **cache_kwargs,
) -> list[RoutingEvent]:
    """Feed ``ids`` through a compressed cache and record the window sets at every eviction step."""
    cache = build_cache(model, policy, budget, window, **cache_kwargs)
    events = listen_for_events(cache, context, ids.shape[1], window)
    feed(model, cache, ids, context, progress, f"{policy} @ {budget}")
    return events


@torch.no_grad()
def feed(model, cache, ids: torch.Tensor, context: int, progress: bool = False, label: str = "") -> None:
    """Prefill ``ids[:, :context]`` into ``cache``, then feed the rest one token at a time."""

    arg = {cache_kwarg(model): cache}
    model(input_ids=ids[:, :context], **arg, use_cache=True)
    for s in tqdm(range(ids.shape[1] - context), desc=label, disable=not progress, leave=False):
        model(input_ids=ids[:, context + s : context + s + 1], **arg, use_cache=True)


def diagnose(
    model,
    tokenizer,
    text_path: str,
    policy: str,
    budget: float,
    *,
    offset: int = 0,
    context: int = 2048,
    continuation: int = 128,
    horizon: int = 32,
    window: int = 8,
    lir_m: int = DEFAULT_LIR_M,
    progress: bool = False,
    **cache_kwargs,
) -> DiagnosticsResult:
    """FMM, churn and LIR of ``policy`` at ``budget`` on a text, against the full cache.

    ``cache_kwargs`` go to ``make_cache`` (``tiers=``, ``options=``, ``gates=``); a tiered cache is
    routed by the same windows the diagnostics group positions into (its window is ``window``).
    """

    check_params(context=context, continuation=continuation, horizon=horizon, window=window, lir_m=lir_m)
    ids = text_tokens(tokenizer, text_path, offset, context + continuation)
    device = next(model.parameters()).device
    ids = ids.to(device)
    # build the compressed cache first: a setting make_cache refuses fails before the long reference pass
    cache = build_cache(model, policy, budget, window, **cache_kwargs)
    events = listen_for_events(cache, context, ids.shape[1], window)
    attention = reference_attention(model, ids, context, progress)  # restores the vlm_kv attention after
    feed(model, cache, ids, context, progress, f"{policy} @ {budget}")
    params = dict(policy=policy, budget=budget, text=str(text_path), offset=offset, context=context,
                  continuation=continuation, horizon=horizon, window=window, lir_m=lir_m,
                  **{k: v for k, v in cache_params(cache_kwargs).items() if k != "window"})
    return summarize(events, attention, window, horizon, lir_m, params)


def check_params(*, context: int, continuation: int, horizon: int, window: int, lir_m: int) -> None:
    """Reject settings that cannot give a diagnostic, before any model loads."""
    for name, value in (("context", context), ("continuation", continuation), ("horizon", horizon),
                        ("window", window), ("lir-m", lir_m)):
        if value < 1:
            raise ValueError(f"--{name} must be >= 1, got {value}")
    if context < 2:
        raise ValueError(f"--context must be >= 2 tokens (a prefill), got {context}")


# ----------------------------------------------------------------------------- sweep columns


@dataclass
class DiagnosticColumns:
    """FMM / churn / LIR columns for the rows of a fidelity sweep (``vlm-kv sweep --diagnostics``).

    The full cache's attention is recorded once per token sequence; each cell's events are
    recorded on the cell's own compressed pass (the fidelity run), so a cell costs no extra run.
    """

    window: int = 8
    horizon: int = 32
    lir_m: int = DEFAULT_LIR_M
    _attention: torch.Tensor | None = field(default=None, repr=False)
    _attention_ids: torch.Tensor | None = field(default=None, repr=False)

    def metrics(self, metric_cls) -> tuple:
        return (metric_cls("fmm", f"future missed mass, next {self.horizon} steps", higher_is_better=False),
                metric_cls("churn", "selection churn between eviction steps", higher_is_better=False))

    def settings(self) -> dict:
        return {"window": self.window, "horizon": self.horizon, "lir_m": self.lir_m}

    @staticmethod
    def full_cache_row() -> dict:
        """The full cache reaches everything and never changes what it holds."""
        return {"fmm": 0.0, "fmm_tokens": 0.0, "churn": 0.0, "lir": None}

    def prepare(self, model, ids: torch.Tensor, context: int, policy: str, budget, cache_kwargs: dict,
                progress: bool = False):
        """(cache factory for ``fidelity.measure``, a callable giving the row's columns after it).

        ``ids`` are fidelity's tokens: all but the last are fed, the last is only a target.
        """
        fed = ids[:, :-1]
        if self._attention_ids is not ids:
            self._attention = reference_attention(model, fed, context, progress)
            self._attention_ids = ids
        attention = self._attention
        cache = build_cache(model, policy, budget, self.window, **cache_kwargs)
        events = listen_for_events(cache, context, fed.shape[1], self.window)

        def finish() -> dict:
            s = summarize(events, attention, self.window, self.horizon, self.lir_m).summary
            return {"fmm": s["fmm_mean"], "fmm_tokens": s["fmm_tokens_mean"], "churn": s["churn_mean"],
                    "lir": s["lir"], "lir_runs": s["lir_runs"]}

        return (lambda: cache), finish


# ----------------------------------------------------------------------------- output


def format_table(result: DiagnosticsResult) -> str:
    p, s = result.params, result.summary

    def num(x, fmt=".4f"):
        return "-" if x is None else format(x, fmt)

    lines = [
        f"policy {p.get('policy')}  budget {p.get('budget')}  context {p.get('context')}  "
        f"continuation {p.get('continuation')}  window {p.get('window')}  horizon {p.get('horizon')}",
        f"{'step':>5} {'seen':>6} {'held tok':>8} {'held win':>8} {'FP win':>7} {'future':>6} {'FMM':>8} {'FMM tok':>8} {'churn':>8}",
    ]
    for r in result.events:
        lines.append(f"{r['step']:>5} {r['seen']:>6} {num(r['held_share'], '.3f'):>8} {num(r['accessible_share'], '.3f'):>8} {num(r['fp_share'], '.3f'):>7} "
                     f"{r['future_steps']:>6} {num(r['fmm']):>8} {num(r['fmm_tokens']):>8} {num(r['churn']):>8}")
    lines.append(f"FMM mean {num(s['fmm_mean'])} (token level {num(s['fmm_tokens_mean'])}) over {s['fmm_events']} "
                 f"events with a full horizon; churn mean {num(s['churn_mean'])}")
    lines.append(f"LIR (m={p.get('lir_m')}) {num(s['lir'], '.3f')}: {s['lir_reactivated']} of {s['lir_runs']} runs "
                 f"reselected within {p.get('horizon')} steps ({s['lir_censored']} censored)")
    if s["fmm_per_layer"]:
        lines.append("FMM per layer: " + " ".join(f"{x:.3f}" for x in s["fmm_per_layer"]))
    return "\n".join(lines)


def plot(results: "DiagnosticsResult | list[DiagnosticsResult]", path: str) -> None:
    """PNG: FMM (window level solid, token level dashed) and churn per event against the decode
    step, one line per result (a list compares policies on the same text)."""
    # lazy: matplotlib is optional (the eval extra)
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib is optional (the eval extra)
    import matplotlib.pyplot as plt

    results = [results] if isinstance(results, DiagnosticsResult) else list(results)
    if not results:
        raise ValueError("nothing to plot")
    p = results[0].params
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for i, result in enumerate(results):
        color = f"C{i}"
        name = f"{result.params.get('policy')} @ {result.params.get('budget')}"
        for ax, key, style, label in ((left, "fmm", "-", name), (left, "fmm_tokens", "--", None),
                                      (right, "churn", "-", name)):
            rows = [r for r in result.events if r.get(key) is not None]
            if rows:
                ax.plot([r["step"] for r in rows], [r[key] for r in rows], style, marker="o", color=color, label=label)
    left.set_ylabel(f"FMM, next {p.get('horizon')} steps (dashed: token level)")
    right.set_ylabel("selection churn (1 - Jaccard)")
    for ax in (left, right):
        ax.set_xlabel("decode step of the event")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"window {p.get('window')} tokens, context {p.get('context')}, continuation {p.get('continuation')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load_result(path: str) -> DiagnosticsResult:
    """A result written by ``vlm-kv diagnose --json``."""

    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    missing = {"params", "events", "summary"} - set(data)
    if missing:
        raise ValueError(f"{path} is not a diagnose --json result: it lacks {sorted(missing)}")
    return DiagnosticsResult(**{k: data[k] for k in ("params", "events", "summary")})
