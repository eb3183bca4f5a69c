"""Routing events of the tiered cache: every window goes to FP, INT2 or out, under the byte budget.

``TierRouter`` runs a routing event (the end of every prefill or prefill chunk, then every ``w``
decode steps): each layer's entries, FP and INT2 alike, are scored together by the policy's scorer
(``LayerRouting``), and the strategy ``TierConfig.fp_unit`` chose decides and applies the moves:
``WindowRouter`` here (``"window"``, QEvict) or ``EntryRouter`` (``"token"``,
``vlm_kv.tiers.entry_router``). Both rank their candidates in one list per group and spend each
group's bytes by rank (``vlm_kv.tiers.groups``).

The window router sums the scores per window (``Scorer.window_reduce``). Windows that hold a
protected entry (sinks, the recent zone) or are not complete yet stay FP. The others are ranked in
one list per *group* and routed by rank (QEvict):

* a group is one (layer, batch, kv head) row for per-head allocations (uniform, pyramid), one
  (layer, batch) for AdaKV's head-adaptive one, and one whole sequence for the global
  allocation (``dbtrimkv``: retention scores compare across layers, heads and modalities);
* the group's bytes ``M`` are the budget's tokens times the FP bytes per token; the forced FP
  windows take ``P`` of them and ``M - P`` is routed:

  1. if every window fits in FP, all stay FP (so a budget that holds everything quantizes nothing);
  2. else, if every window fits with the lowest-ranked ones in INT2, the most FP windows that
     allow it (nothing evicted, as few quantized as possible);
  3. else the spec's split: the top windows take ``(1 - q) (M - P)`` as FP, the next take
     what is left as INT2 windows, the rest are evicted.

  Rule 2 is ours: the spec's fixed split would quantize 70 % of the windows at a budget just
  below the full cache, where nothing needs to be lost. It only applies when it keeps at
  least as many FP windows as rule 3.
* A window's FP cost is its entries' bytes plus its dormant ledger entry (held while it is FP);
  its INT2 cost is one quantized window. So held bytes (FP + INT2 + scales + ledger) never
  exceed the budget after an event.
* If a group's forced windows alone exceed its bytes (a tiny budget at a short prompt), the
  group falls back to the entry-level rule: each row keeps its best protected entries up to its
  capacity, everything else (ledger included) goes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vlm_kv.config import TierConfig
from vlm_kv.eviction.evictor import Evictor
from vlm_kv.policies.base import Scorer
from vlm_kv.storage.allocation import Allocation, GlobalTopK
from vlm_kv.storage.ledger import TokenLedger
from vlm_kv.storage.store import Entries, PaddedView
from vlm_kv.tiers.entry_router import EntryRouter
from vlm_kv.tiers.global_prefill import GlobalPrefillRouting
from vlm_kv.tiers.groups import GroupBytes, Ranking, cat_records, per_layer
from vlm_kv.tiers.int2_tier import Int2Tier, NewWindows, RefreshedSlots, SpillCopies
from vlm_kv.tiers.routing import LayerRouting, RoutedLayer, RouterStrategy
from vlm_kv.tiers.windows import (
    EVICT,
    FP,
    INT2,
    gather_windows,
    reduce_windows,
    window_value,
)

__all__ = ["EVICT", "FP", "INT2", "LayerwiseRouting", "TierRouter", "WindowRouter", "merge_views", "reduce_windows", "router_for", "unsort"]


def merge_views(fp: PaddedView, tier: PaddedView, sort: bool) -> tuple[PaddedView, torch.Tensor | None]:
    """FP and INT2 entries of a layer side by side per row ([B, H, Lf + Lq]); with ``sort`` in
    position order (scorers that smooth along positions need it), returning the permutation.
    A ``tier`` view without keys (width 0) gives a merged view without keys."""

    def cat(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cat([a, b.to(a.dtype)], dim=2)

    view = PaddedView(
        keys=cat(fp.keys, tier.keys) if tier.keys.shape[-1] else fp.keys[..., :0],
        values=cat(fp.values, tier.values) if fp.values.shape[-1] and tier.values.shape[-1] else fp.keys[..., :0],
        positions=cat(fp.positions, tier.positions),
        modality=cat(fp.modality, tier.modality),
        valid=cat(fp.valid, tier.valid),
        state={n: cat(fp.state[n], tier.state[n]) for n in fp.state},
    )
    if not sort:
        return view, None
    key = torch.where(view.valid, view.positions, torch.full_like(view.positions, 2**62))
    perm = torch.argsort(key, dim=-1, stable=True)

    def gather(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 4:
            return t.gather(2, perm[..., None].expand(-1, -1, -1, t.shape[-1]))
        return t.gather(2, perm)

    sorted_view = PaddedView(
        keys=view.keys if not view.keys.shape[-1] else gather(view.keys), values=view.values if not view.values.shape[-1] else gather(view.values),
        positions=gather(view.positions), modality=gather(view.modality),
        valid=gather(view.valid), state={n: gather(t) for n, t in view.state.items()},
    )
    return sorted_view, perm


def unsort(values: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Inverse of ``merge_views``' permutation for a [B, H, L] quantity."""
    return torch.empty_like(values).scatter_(-1, perm, values)


def router_for(config: TierConfig) -> RouterStrategy:
    """The strategy ``config.fp_unit`` names: whole windows (QEvict) or single entries in FP."""
    return EntryRouter(config) if config.fp_unit == "token" else WindowRouter(config)


class TierRouter:
    """A tiered cache's routing events: each layer's entries and scores gathered, then decided and
    applied by the strategy ``TierConfig.fp_unit`` chose (``router_for``)."""

    def __init__(self, config: TierConfig) -> None:
        self.config = config
        self.strategy = router_for(config)

    @torch.no_grad()
    def route(self, evictor: Evictor, layers: Sequence[RoutedLayer], ledger: TokenLedger) -> None:
        """One routing event over every layer; afterwards the held bytes are within the budget."""
        caps, scorer, allocation = evictor.begin_step(ledger)
        before = sum(layer.num_entries() for layer in layers)
        event = _Event(evictor, ledger, caps, scorer, allocation, len(layers))
        self._decide_and_apply(event, layers, [event.routing(layer, self.config.window) for layer in layers], before)

    def _decide_and_apply(self, event: "_Event", layers: Sequence[RoutedLayer], routings: Sequence[LayerRouting],
                          before: int) -> None:
        """The event over every layer at once: decide, carry out (the strategy's ``apply_all``), count what left."""
        decisions, fallback = self._decide(layers, routings, event.allocation, event.scorer)
        self.strategy.apply_all(layers, routings, decisions, fallback)
        event.evictor.end_step(before, sum(layer.num_entries() for layer in layers))

    # ------------------------------------------------------------ layer by layer, during a prefill
    def begin_layerwise(self, evictor: Evictor, ledger: TokenLedger, num_layers: int) -> "LayerwiseRouting | None":
        """A prompt's routing event taken one layer at a time, right after each layer's attention,
        or None where a layer's decisions depend on other layers (a global allocation ranks one
        list per sequence over every layer: that event waits for the end of the forward)."""
        evictor.phase = "prefill"
        caps, scorer, allocation = evictor.begin_step(ledger)
        event = _Event(evictor, ledger, caps, scorer, allocation, num_layers)
        if allocation.is_global:
            if self._demotes_early(event):
                return GlobalPrefillRouting(event, self.strategy, self.config.window)
            return None
        return LayerwiseRouting(event)

    def _demotes_early(self, event: "_Event") -> bool:
        """A global event can send entries that can no longer be FP to INT2 before it runs
        (``vlm_kv.tiers.global_prefill``) when FP is chosen per entry, the allocation is a plain
        global top-k, and every layer's scores are a function of each entry's own state and
        position (the same in either tier)."""
        allocation = event.allocation
        plain = isinstance(allocation, GlobalTopK) and allocation.is_plain
        scorers = [event.scorer.for_layer(i) for i in range(event.num_layers)]
        return (isinstance(self.strategy, EntryRouter) and plain
                and all(s.score_is_per_entry and not s.score_reads_keys for s in scorers))

    @torch.no_grad()
    def route_layer(self, step: "LayerwiseRouting", layer: RoutedLayer) -> None:
        """Route one layer now. Its groups (a row, or a layer's rows) hold only its own entries, so
        this decides exactly what the end-of-forward event would for it."""
        if isinstance(step, GlobalPrefillRouting):
            step.after_layer(layer)
            return
        event = step.event
        routing = event.routing(layer, self.config.window)
        step.before[layer.layer_idx] = layer.num_entries()
        decisions, fallback = self._decide([layer], [routing], event.allocation, event.scorer)
        self.strategy.apply(layer, routing, decisions[0], fallback[0])

    @torch.no_grad()
    def finish_layerwise(self, step: "LayerwiseRouting", layers: Sequence[RoutedLayer]) -> None:
        """End of the prefill: route the layers that did not attend (if any) and close the event
        (a global ranking's event runs here over every layer)."""
        if isinstance(step, GlobalPrefillRouting):
            before = sum(step.before.get(layer.layer_idx, layer.num_entries()) for layer in layers)
            self._decide_and_apply(step.event, layers, step.event_routings(layers), before)
            return
        for layer in layers:
            if layer.layer_idx not in step.before:
                self.route_layer(step, layer)
        before = sum(step.before.values())
        step.event.evictor.end_step(before, sum(layer.num_entries() for layer in layers))

    def _decide(self, layers: Sequence[RoutedLayer], routings: Sequence[LayerRouting], allocation: Allocation,
                scorer: Scorer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        # the one seam every event's decisions pass through: vlm_kv.testing.route_with_forced_decision
        # overrides it on an instance to force one window's move
        return self.strategy.decide(layers, routings, allocation, scorer)


@dataclass
class _Event:
    """What one routing event fixes for all its layers: each sequence's capacity, the step's scorer
    and allocation, and how many layers the allocation spreads the budget over."""

    evictor: Evictor
    ledger: TokenLedger
    caps: torch.Tensor
    scorer: Scorer
    allocation: Allocation
    num_layers: int

    def __post_init__(self) -> None:
        # each sequence's capacity over its real tokens (the entry router's INT2 share follows it),
        # the same for every layer of the event
        self.budget_fraction = self.caps.double() / self.ledger.valid_tokens.to(self.caps.device).clamp(min=1).double()

    def layer_capacity(self, layer_idx: int) -> torch.Tensor:
        """[B] tokens per head layer ``layer_idx`` may hold at this event."""
        protected_window = self.evictor.protected(self.caps, self.scorer.for_layer(layer_idx))[1]  # each sequence's own
        return self.allocation.for_layer(layer_idx).layer_capacity(layer_idx, self.num_layers, self.caps,
                                                                   protected_window)

    def routing(self, layer: RoutedLayer, window: int) -> LayerRouting:
        """One layer's entries (FP and INT2 alike), scored together, with its capacity."""
        evictor, ledger, caps = self.evictor, self.ledger, self.caps
        states = evictor.scorer.state_names
        layer_scorer = self.scorer.for_layer(layer.layer_idx)
        cap_layer = self.layer_capacity(layer.layer_idx)
        # a scorer of state and positions only: no key is laid out or dequantized to be scored (the
        # entries the event moves are read from ``source``)
        with_keys = layer_scorer.score_reads_keys
        fp = layer.store.padded_view(with_values=False, with_keys=with_keys, states=states)
        tv = layer.tier.view(states=states, with_values=False, with_keys=with_keys, dtype=fp.keys.dtype)
        # scores of single entries need no position order (smoothing along positions does)
        merged, perm = merge_views(fp, tv.view, sort=not layer_scorer.score_is_per_entry)
        scores = evictor.layer_scores(self.scorer, layer, merged, cap_layer, ledger, self.num_layers)
        if perm is not None:
            scores = unsort(scores, perm)
        return LayerRouting(
            fp=fp, source=layer.store.entry_source(), tier_slot=tv.slot, scores=scores,
            positions=torch.cat([fp.positions, tv.view.positions], dim=2),
            valid=torch.cat([fp.valid, tv.view.valid], dim=2),
            num_windows=-(-layer.seen // window), cap=cap_layer,
            origin=ledger.first_positions.to(caps.device).clamp(max=layer.seen), window=window,
            budget_fraction=self.budget_fraction,
        )


class LayerwiseRouting:
    """A prompt's routing event in flight, one layer at a time (``TierRouter.begin_layerwise``):
    the prompt's full keys and values never sit in every layer at once."""

    def __init__(self, event: _Event) -> None:
        self.event = event
        self.before: dict[int, int] = {}  # layer -> entries it held before it was routed


@dataclass
class WindowRecords:
    """The windows of a routing event that hold an entry, flat over layers."""

    group: torch.Tensor         # ranking group
    score: torch.Tensor         # reduced window score (float64)
    fp_cost: torch.Tensor       # bytes held in FP: its entries, plus its dormant ledger entry if any
    forced: torch.Tensor        # holds a protected entry or is incomplete: stays FP
    layer: torch.Tensor         # layer index
    index: torch.Tensor         # flat (row * Wn + window id) within its layer
    value: torch.Tensor | None  # linear worth, for int2_value only


class WindowRouter:
    """QEvict's routing: whole windows go to FP, INT2 or out (``fp_unit="window"``)."""

    def __init__(self, config: TierConfig) -> None:
        self.config = config

    # ------------------------------------------------------------------ decisions
    def decide(self, layers: Sequence[RoutedLayer], routings: Sequence[LayerRouting], allocation: Allocation,
               scorer: Scorer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer: [B, H, Wn] decisions (FP / INT2 / EVICT) and [B, H] fallback rows."""
        groups = GroupBytes.of(allocation, layers, routings)
        b_q = layers[0].tier.window_bytes()
        t = cat_records([self._windows(li, layer, r, scorer, groups.rows[li], b_q)
                         for li, (layer, r) in enumerate(zip(layers, routings))])
        free = groups.budget - groups.total(t.group, t.fp_cost * t.forced)  # M - P per group
        fallback_group = free < 0

        decision = torch.full_like(t.group, EVICT)
        decision[t.forced] = FP
        cand = torch.nonzero(~t.forced).flatten()
        if cand.numel():
            value = t.value[cand] if t.value is not None else None
            decision[cand] = self._route_candidates(t.group[cand], t.score[cand], t.fp_cost[cand], free, b_q,
                                                    groups.count, value)
        decision[fallback_group[t.group] & ~t.forced] = EVICT
        B, H = groups.batch_size, groups.num_kv_heads
        decisions = per_layer(decision, t.layer, t.index, [(B, H, r.num_windows) for r in routings])
        return decisions, groups.fallback_rows(fallback_group)

    def _windows(self, li: int, layer: RoutedLayer, r: LayerRouting, scorer: Scorer, row_group: torch.Tensor,
                 b_q: int) -> WindowRecords:
        """Layer ``li``'s windows that hold an entry, with their scores and FP costs."""
        device = r.scores.device
        B, H = r.scores.shape[:2]
        seen, Wn = layer.seen, r.num_windows
        b_tok = layer.store.bytes_per_entry
        size = B * H * Wn
        row_id = torch.arange(B * H, device=device).view(B, H, 1)
        wid = r.window_ids(r.positions)
        flat = (row_id * Wn + wid).masked_fill(~r.valid, size)  # empty slots to a dump bin
        count = torch.zeros(size + 1, dtype=torch.long, device=device).index_add_(0, flat.reshape(-1), r.valid.reshape(-1).long())[:size]
        pinned = r.valid & ((r.scores == float("inf")) | r.incomplete(wid, seen))
        forced = torch.zeros(size + 1, dtype=torch.bool, device=device).index_put_((flat[pinned],), torch.tensor(True, device=device))[:size]
        reduce = scorer.for_layer(layer.layer_idx).window_reduce
        score = reduce_windows(r.scores.masked_fill(~r.valid, float("-inf")).reshape(-1), flat.reshape(-1).clamp(max=size - 1), size, reduce)
        ledger = torch.zeros(size, dtype=torch.bool, device=device)
        if len(layer.tier):
            ledger[layer.tier.row * Wn + layer.tier.window_id] = True
        fp_cost = count * b_tok + ledger.long() * b_q
        ids = torch.nonzero(count > 0).flatten()
        return WindowRecords(
            group=row_group[ids // Wn], score=score[ids], fp_cost=fp_cost[ids], forced=forced[ids],
            layer=torch.full_like(ids, li), index=ids,
            value=window_value(score[ids], reduce) if self.config.int2_value is not None else None,
        )

    def _route_candidates(self, group: torch.Tensor, score: torch.Tensor, cost: torch.Tensor, free: torch.Tensor,
                          b_q: int, groups: int, value: torch.Tensor | None = None) -> torch.Tensor:
        """Decisions for the routed (non-forced) windows, ranked per group by score."""
        if self.config.quantize_all:
            return torch.full_like(group, INT2)
        ranking = Ranking.by_score(group, score, groups)
        g, rank, c = ranking.group, ranking.rank, cost[ranking.order]
        cum, group_cost = ranking.cumsum(c)  # inclusive prefix cost within each group
        all_fp = (group_cost <= free)[g]
        if value is not None:
            n_fp, n_q = self._split_by_value(ranking, c, cum, value[ranking.order], free, b_q)
        else:
            n_fp, n_q = self._split_by_share(ranking, c, cum, free, b_q)
        out = torch.where(rank < n_fp[g], FP, torch.where(rank < (n_fp + n_q)[g], INT2, EVICT))
        out = torch.where(all_fp, torch.full_like(out, FP), out)
        return ranking.unrank(out)

    def _split_by_share(self, ranking: Ranking, c: torch.Tensor, cum: torch.Tensor, free: torch.Tensor,
                        b_q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(n_fp, n_q) per group by rules 2 and 3 (the fixed INT2 share q); ``c`` and ``cum``: each
        window's FP cost and the inclusive cost up to it, in ranked order."""
        q = self.config.int2_share
        g, rank, n = ranking.group, ranking.rank, ranking.counts
        room = free[g].double()
        # rule 2: the most FP windows with every other window fitting as INT2
        fits = (cum + (n[g] - rank - 1) * b_q) <= room
        first_miss = torch.full((ranking.groups,), 2**62, dtype=torch.long, device=g.device)
        first_miss.scatter_reduce_(0, g[~fits], rank[~fits], reduce="amin")
        n_fit = torch.minimum(first_miss, n)
        fit_exists = (n * b_q <= free) & (q > 0)
        # rule 3: the spec's split
        fp_spec = cum <= (1.0 - q) * room
        n_spec = ranking.totals(fp_spec.long())
        used = ranking.totals(c * fp_spec)
        slots = torch.div((free - used).clamp(min=0), b_q, rounding_mode="floor") if q > 0 else torch.zeros_like(used)
        use_fit = fit_exists & (n_fit >= n_spec)
        n_fp = torch.where(use_fit, n_fit, n_spec)
        n_q = torch.where(use_fit, n - n_fit, slots)
        return n_fp, n_q

    def _split_by_value(self, ranking: Ranking, c: torch.Tensor, cum: torch.Tensor, v: torch.Tensor,
                        free: torch.Tensor, b_q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(n_fp, n_q) per group maximizing FP value + int2_value * INT2 value within the bytes.

        Candidate k FP windows (the top k, k = each rank; all-FP is rule 1) leaves
        ``free - cost(top k)`` for INT2 windows of ``b_q`` bytes each, taken next in rank."""
        eps = float(self.config.int2_value)
        g, rank, n, start, groups = ranking.group, ranking.rank, ranking.counts, ranking.start, ranking.groups
        cum_v, _ = ranking.cumsum(v)  # inclusive, within group
        v_before = cum_v - v
        room = free[g] - (cum - c)  # bytes left with the windows ranked above this one in FP
        n_q = torch.minimum(torch.div(room.clamp(min=0), b_q, rounding_mode="floor"), n[g] - rank)
        last = start[g] + rank + n_q - 1  # the last INT2 window's place, in group order
        v_upto = torch.where(rank + n_q > 0, cum_v[last.clamp(min=0)], torch.zeros_like(v))
        worth = (v_before + eps * (v_upto - v_before)).masked_fill(room < 0, float("-inf"))
        best = torch.full((groups,), float("-inf"), dtype=worth.dtype, device=v.device)
        best.scatter_reduce_(0, g, worth, reduce="amax")
        at_best = worth == best[g]
        k = torch.zeros(groups, dtype=torch.long, device=v.device)  # ties: the most FP windows
        k.scatter_reduce_(0, g[at_best], rank[at_best], reduce="amax")
        chosen = at_best & (rank == k[g])
        q_of = torch.zeros(groups, dtype=torch.long, device=v.device)
        q_of[g[chosen]] = n_q[chosen]
        return k, q_of

    # ------------------------------------------------------------------ apply
    def apply_all(self, layers: Sequence[RoutedLayer], routings: Sequence[LayerRouting],
                  decisions: Sequence[torch.Tensor], fallback: Sequence[torch.Tensor]) -> None:
        """``apply`` layer by layer."""
        for layer, r, dec, fb in zip(layers, routings, decisions, fallback):
            self.apply(layer, r, dec, fb)

    def apply(self, layer: RoutedLayer, r: LayerRouting, decision: torch.Tensor, fallback: torch.Tensor) -> None:
        """Carry out one layer's window decisions: FP windows kept, demoted (through their stored
        codes when the ledger has them) or dropped; INT2 windows kept, promoted or dropped."""
        store, tier = layer.store, layer.tier
        w = self.config.window
        Wn = decision.shape[2]
        fp_pos = r.fp.positions
        wid = r.window_ids(fp_pos).clamp(max=max(Wn - 1, 0))
        dec_fp = decision.gather(2, wid) if Wn else torch.full_like(fp_pos, EVICT)
        keep_fp, demote = r.fp_moves(dec_fp, fallback)

        # the ledger's windows
        n = len(tier)
        if n:
            t_dec = decision.view(-1, Wn)[tier.row, tier.window_id.clamp(max=Wn - 1)] if Wn else torch.full_like(tier.row, EVICT)
            t_fallback = fallback.view(-1)[tier.row]
            t_dec = torch.where(t_fallback, torch.full_like(t_dec, EVICT), t_dec)
            promote = tier.active & (t_dec == FP)
            stay = tier.active & (t_dec == INT2)
            keep_dormant = ~tier.active & (t_dec == FP)
            reactivate = ~tier.active & (t_dec == INT2)
            tier.counters.evicted_windows += int((tier.active & (t_dec == EVICT)).sum())
        else:
            promote = stay = keep_dormant = reactivate = torch.zeros(0, dtype=torch.bool, device=decision.device)

        insert = self._promoted_entries(tier, promote, store.state_names)
        spill = tier.spill is not None
        demoted = gather_windows(r.fp, r.source, demote, w, Wn, store.state_names, r.origin, tier.rope, keep_original=spill)
        # which demoted windows have a dormant ledger entry: reuse its codes
        new_windows, refreshed = None, None
        keep = stay | keep_dormant | promote | reactivate
        active = stay | reactivate
        if demoted is not None:
            ledger_idx = r.ledger_lookup(tier)[demoted.row * Wn + demoted.window_id]
            reused = ledger_idx >= 0
            if bool(reused.any()):
                kept_position = torch.cumsum(keep.long(), 0) - 1
                refreshed = RefreshedSlots(
                    index=kept_position[ledger_idx[reused]],
                    positions=demoted.positions[reused],
                    modality=demoted.modality[reused],
                    state={k: v[reused] for k, v in demoted.state.items()},
                )
            fresh = ~reused
            if bool(fresh.any()):
                idx = torch.nonzero(fresh).flatten()
                new_windows = NewWindows(
                    codes=tier.quantize(demoted.keys[idx], demoted.values[idx]),
                    row=demoted.row[idx], window_id=demoted.window_id[idx],
                    positions=demoted.positions[idx], modality=demoted.modality[idx],
                    state={k: v[idx] for k, v in demoted.state.items()},
                    spill=SpillCopies.from_device(demoted.original_keys[idx], demoted.values[idx], tier.pin_spill)
                    if spill else None,
                )
            tier.counters.ledger_reuses += int(reused.sum())
            tier.counters.quantized += int(fresh.sum())
            tier.counters.demotions += int(reused.sum()) + int(fresh.sum())
        tier.counters.promotions += int(promote.sum())
        tier.rebuild(keep, active, refreshed, new_windows)
        store.compact(keep_fp, insert=insert)

    @staticmethod
    def _promoted_entries(tier: Int2Tier, promote: torch.Tensor, state_names: tuple[str, ...]) -> Entries | None:
        """The entries of the promoted windows: their original copies from the spill tier when it
        is on (lossless), else dequantized back to the model dtype."""
        idx = torch.nonzero(promote).flatten()
        if idx.numel() == 0:
            return None
        pos = tier.positions[idx]
        if tier.spill is not None:
            keys, values = tier.spill.restore(idx, tier.device)  # post-RoPE keys as first cached
        else:
            keys, values = tier.dequantize(idx)
        present = pos >= 0
        w = tier.window
        return Entries(
            rows=tier.row[idx][:, None].expand(-1, w)[present],
            keys=keys[present], values=values[present],
            positions=pos[present], modality=tier.modality[idx][present],
            state={n: tier.state[n][idx][present] for n in state_names},
        )
