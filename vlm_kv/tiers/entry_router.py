"""Token-granular FP routing for the tiered cache (``TierConfig(fp_unit="token")``).

QEvict routes whole windows of ``w`` tokens: a window is FP, INT2 or gone. The INT2 tier needs
windows (a key grid spans ``w`` tokens), but the FP tier does not, and choosing FP entries a
window at a time costs the learned gates dearly: on pg84 (SmolLM2, bf16, 2048 + 128 tokens) the
window-routed cache with no INT2 share (``int2_share=0``) has KL 0.0956 at budget 0.1 against
0.0459 for the same gates choosing single entries (docs/tiers.md, session 7). So here:

* **FP is chosen per entry**: the group's entries (FP and INT2 alike, one score list as for
  windows) are ranked by their own scores and the top ones take the FP bytes;
* **INT2 is chosen per window** among the rest: a window's score is reduced over the entries
  that did not make FP (``Scorer.window_reduce``), and the top windows take the INT2 bytes;
* an INT2 window may have **holes**: slots whose entry is FP (or gone). Its codes cover every
  entry the window held when it was first quantized, so an entry can move FP -> INT2 -> FP
  alone, always through the same codes (the write-once ledger, per slot). A window stays in the
  ledger while any of its entries is alive in either tier (dormant when all are FP).

Bytes are charged exactly as held: ``b_tok`` per FP entry, one quantized window (``b_q``) per
window kept in the ledger, active or dormant. The three rules of the window router
(``vlm_kv.tiers.window_router``) carry over with entries in place of FP windows: (1) everything
fits in FP: all FP; (2) the most top entries in FP such that every other entry fits in INT2
windows; (3) the top entries within ``(1 - q)`` of the routed bytes in FP, then windows in INT2
while bytes last, the rest evicted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vlm_kv.config import TierConfig
from vlm_kv.policies.base import Scorer
from vlm_kv.storage.allocation import Allocation
from vlm_kv.storage.store import Entries
from vlm_kv.tiers.groups import (
    GroupBytes,
    Ranking,
    cat_records,
    exclusive_cumsum,
    per_layer,
    segment_counts,
)
from vlm_kv.tiers.int2_tier import Int2Tier, NewWindows, QuantizedWindows, RefreshedSlots, SpillCopies, TierCounters
from vlm_kv.tiers.routing import LayerRouting, RoutedLayer
from vlm_kv.tiers.windows import (
    EVICT,
    FP,
    INT2,
    WindowEntries,
    gather_windows,
    reduce_windows,
    window_of,
)


@dataclass
class EntryRecords:
    """The valid entries of a routing event (FP and INT2 alike), flat over layers."""

    group: torch.Tensor   # ranking group
    score: torch.Tensor   # the entry's own score (protected +inf)
    win: torch.Tensor     # its window, flat over the event's windows (``EventWindows``)
    forced: torch.Tensor  # protected, or in an incomplete window: stays FP
    btok: torch.Tensor    # its FP bytes
    layer: torch.Tensor   # layer index
    index: torch.Tensor   # flat place in its layer's [B, H, Lf + Lq] scores


@dataclass
class EventWindows:
    """Every (layer, row, window) of a routing event, flat: layer ``li``'s windows are
    ``offsets[li] .. offsets[li] + sizes[li]``."""

    group: torch.Tensor   # [count] ranking group
    ledger: torch.Tensor  # [count] the ledger holds the window (active or dormant)
    forced: torch.Tensor  # [count] the window holds a forced entry
    offsets: list[int]
    sizes: list[int]
    reduces: list[str]    # each layer's scorer window reduction

    @property
    def count(self) -> int:
        return int(self.group.numel())


@dataclass
class EntryBudget:
    """What the routed entries of each group may spend."""

    free: torch.Tensor   # [groups] bytes left after the forced entries and their ledgered windows (M - P)
    share: torch.Tensor  # [groups] float64 INT2 share q of the group's sequence
    groups: int
    window_bytes: int    # b_q: one quantized window


class EntryRouter:
    """FP chosen per entry, INT2 per window with holes (``fp_unit="token"``)."""

    def __init__(self, config: TierConfig) -> None:
        self.config = config

    # ------------------------------------------------------------------ decisions
    def decide(self, layers: Sequence[RoutedLayer], routings: Sequence[LayerRouting], allocation: Allocation,
               scorer: Scorer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer: [B, H, Lf + Lq] decisions (FP / INT2 / EVICT) of every entry, laid out like the
        routing's scores, and [B, H] fallback rows."""
        groups = GroupBytes.of(allocation, layers, routings)
        device = routings[0].scores.device
        b_q = layers[0].tier.window_bytes()
        # every group lies in one sequence: its INT2 share is that sequence's
        share = self.config.share_for(routings[0].budget_fraction)  # [B]
        q = share.to(device=device, dtype=torch.float64)[groups.sequence_of_groups()]
        e, windows = self._entries(layers, routings, scorer, groups)

        # forced entries are FP; a ledgered window holding one is kept (dormant or active) and paid here
        windows.forced[e.win[e.forced]] = True
        forced_cost = groups.total(e.group, e.btok * e.forced)
        forced_cost.index_add_(0, windows.group, (windows.forced & windows.ledger).long() * b_q)
        free = groups.budget - forced_cost
        fallback_group = free < 0

        decision = torch.full_like(e.group, EVICT)
        decision[e.forced] = FP
        cand = torch.nonzero(~e.forced).flatten()
        if cand.numel():
            decision[cand] = self._route_entries(cand, e, windows, EntryBudget(free, q, groups.count, b_q))
        decision[fallback_group[e.group] & ~e.forced] = EVICT
        decisions = per_layer(decision, e.layer, e.index, [tuple(r.scores.shape) for r in routings])
        return decisions, groups.fallback_rows(fallback_group)

    @staticmethod
    def _entries(layers: Sequence[RoutedLayer], routings: Sequence[LayerRouting], scorer: Scorer,
                 groups: GroupBytes) -> tuple[EntryRecords, EventWindows]:
        """The event's valid entries and its windows (``forced`` still unset)."""
        device = routings[0].scores.device
        B, H = groups.batch_size, groups.num_kv_heads
        parts, win_group, win_ledger, offsets, sizes, reduces = [], [], [], [], [], []
        offset = 0
        for li, (layer, r) in enumerate(zip(layers, routings)):
            Wn = r.num_windows
            size = B * H * Wn
            groups_of_rows = groups.rows[li]
            row_id = torch.arange(B * H, device=device).view(B, H, 1)
            wid = r.window_ids(r.positions)
            flat = (row_id * Wn + wid).reshape(-1)
            valid = r.valid.reshape(-1)
            scores = r.scores.reshape(-1)
            pinned = r.forced(layer.seen).reshape(-1)
            idx = torch.nonzero(valid).flatten()
            parts.append(EntryRecords(
                group=groups_of_rows[flat[idx] // Wn], score=scores[idx], win=flat[idx] + offset, forced=pinned[idx],
                btok=torch.full_like(idx, layer.store.bytes_per_entry), layer=torch.full_like(idx, li), index=idx,
            ))
            ledger = torch.zeros(size, dtype=torch.bool, device=device)
            if len(layer.tier):
                ledger[r.window_keys(layer.tier)] = True
            if r.provisional is not None:
                # quantized early in this event from every entry they hold, as a fresh window would be:
                # charged as fresh (one window if INT2), not as ledgered ones
                ledger &= ~r.provisional
            win_group.append(groups_of_rows[torch.arange(size, device=device) // Wn])
            win_ledger.append(ledger)
            offsets.append(offset)
            sizes.append(size)
            reduces.append(scorer.for_layer(layer.layer_idx).window_reduce)
            offset += size
        w_group = torch.cat(win_group)
        windows = EventWindows(w_group, torch.cat(win_ledger), torch.zeros(offset, dtype=torch.bool, device=device),
                               offsets, sizes, reduces)
        return cat_records(parts), windows

    def _route_entries(self, cand: torch.Tensor, e: EntryRecords, windows: EventWindows,
                       budget: EntryBudget) -> torch.Tensor:
        """Decisions of the non-forced entries ``cand`` (indices into ``e``)."""
        device = cand.device
        free, q, groups, b_q = budget.free, budget.share, budget.groups, budget.window_bytes
        w_group, w_ledger, w_forced, NW = windows.group, windows.ledger, windows.forced, windows.count
        ranking = Ranking.by_score(e.group[cand], e.score[cand], groups)
        order = ranking.order
        g, rank, n, start = ranking.group, ranking.rank, ranking.counts, ranking.start
        ranked = cand[order]
        win, btok = e.win[ranked], e.btok[ranked]
        N = g.numel()
        pos = torch.arange(N, device=device)

        first = torch.full((NW,), N, dtype=torch.long, device=device).scatter_reduce_(0, win, pos, reduce="amin")
        last = torch.full((NW,), -1, dtype=torch.long, device=device).scatter_reduce_(0, win, pos, reduce="amax")
        # the best-ranked entry of a ledgered window pays for keeping it, unless a forced entry already does
        pays_ledger = (first[win] == pos) & (w_ledger & ~w_forced)[win]
        cost = btok + b_q * pays_ledger.long()
        cum, group_cost = ranking.cumsum(cost)  # inclusive, within group
        all_fp = group_cost <= free  # rule 1

        # INT2 bytes if the top ``rank`` entries are FP: windows with an entry ranked lower, except those
        # already paid (ledgered with a forced entry, or with an FP entry ranked above)
        has_cand = last >= 0
        chargeable = has_cand & ~(w_ledger & w_forced)
        hist_last = segment_counts(last[chargeable], N + 1)
        suffix = torch.flip(torch.cumsum(torch.flip(hist_last, [0]), 0), [0])  # windows with last >= p
        end = start + n
        above = suffix[:N] - ranking.spread(suffix[end])
        paid = chargeable & w_ledger
        pf = exclusive_cumsum(segment_counts(first[paid], N + 1))  # paid windows with first < p
        pl = exclusive_cumsum(segment_counts(last[paid], N + 1))
        prepaid = (pf[:N] - pl[:N]) - ranking.spread(pf[start] - pl[start])  # paid windows with first < p <= last
        fits = (cum - cost) + b_q * (above - prepaid) <= ranking.spread(free)
        n_fit = torch.full((groups,), -1, dtype=torch.long, device=device).scatter_reduce_(0, g[fits], rank[fits], reduce="amax")
        # rule 3
        fp_spec = cum <= ranking.spread((1.0 - q) * free.double())
        n_spec = ranking.totals(fp_spec.long())
        used = ranking.totals(cost * fp_spec)
        use_fit = (n_fit >= 0) & (n_fit >= n_spec) & (q > 0)
        n_fp = torch.where(use_fit, n_fit, n_spec)
        n_fp = torch.where(all_fp, n, n_fp)

        is_fp = rank < ranking.spread(n_fp)
        # windows with an entry left out of FP compete for INT2; paid ones take it at no extra cost
        rest_win = win[~is_fp]
        w_rest = torch.zeros(NW, dtype=torch.bool, device=device)
        w_rest[rest_win] = True
        paid_now = w_ledger & (w_forced | (first < (start + n_fp)[w_group]))
        w_paid = w_rest & paid_now
        w_int2 = w_paid.clone()
        w_int2 |= w_rest & use_fit[w_group]
        contest = w_rest & ~w_paid & ~use_fit[w_group] & ~all_fp[w_group]
        contest &= (q > 0)[w_group]
        if bool(contest.any()):
            wscore = self._window_scores(ranked[~is_fp], e, windows)
            ids = torch.nonzero(contest).flatten()
            by_window = Ranking.by_score(w_group[ids], wscore[ids], groups)
            ids = ids[by_window.order]
            slots = torch.div((free - used).clamp(min=0), b_q, rounding_mode="floor")
            w_int2[ids[by_window.rank < slots[by_window.group]]] = True

        out = torch.where(is_fp, FP, torch.where(w_int2[win], INT2, EVICT))
        return ranking.unrank(out)

    @staticmethod
    def _window_scores(entries: torch.Tensor, e: EntryRecords, windows: EventWindows) -> torch.Tensor:
        """[windows.count] window scores reduced over the entries ``entries`` (indices into ``e``), per
        layer's scorer reduction."""
        out = torch.full((windows.count,), float("-inf"), dtype=torch.float64, device=entries.device)
        lay = e.layer[entries]
        for li, (offset, size, reduce) in enumerate(zip(windows.offsets, windows.sizes, windows.reduces)):
            mine = entries[lay == li]
            if mine.numel() == 0:
                continue
            out[offset : offset + size] = reduce_windows(e.score[mine], e.win[mine] - offset, size, reduce)
        return out

    # ------------------------------------------------------------------ apply
    def apply(self, layer: RoutedLayer, r: LayerRouting, decision: torch.Tensor, fallback: torch.Tensor) -> None:
        """Carry out one layer's entry decisions: FP entries kept, demoted into (new or ledgered)
        windows or dropped; INT2 slots kept, promoted alone or dropped; windows kept while any of
        their entries lives."""
        self.apply_all([layer], [r], [decision], [fallback])

    def apply_all(self, layers: Sequence[RoutedLayer], routings: Sequence[LayerRouting],
                  decisions: Sequence[torch.Tensor], fallback: Sequence[torch.Tensor]) -> None:
        """``apply`` for every layer of an event, with the fresh windows of all layers quantized in
        one call where their tiers quantize alike. Why: each layer has a few fresh windows, and one
        quantization is a few dozen small tensor operations (0.45 ms a layer at 8192 tokens, a tenth
        of an event); windows are quantized independently, so the codes are the same."""
        moves = [self._work_out(layer, r, d, fb) for layer, r, d, fb in zip(layers, routings, decisions, fallback)]
        for m, codes in zip(moves, _quantize_fresh(moves)):
            self._carry_out(m, codes)

    def _work_out(self, layer: RoutedLayer, r: LayerRouting, decision: torch.Tensor,
                  fallback: torch.Tensor) -> "LayerMoves":
        """One layer's moves, worked out from its decisions; nothing in the layer changes yet."""
        tier = layer.tier
        w = self.config.window
        B, H = decision.shape[:2]
        Wn = r.num_windows
        Lf = r.fp.length
        dec_fp, dec_t = decision[..., :Lf], decision[..., Lf:]
        rows_fallback = fallback[..., None]
        keep_fp, demote = r.fp_moves(dec_fp, fallback)
        slot = r.tier_slot
        t_valid = slot >= 0
        stay = t_valid & (dec_t == INT2) & ~rows_fallback
        promote = t_valid & (dec_t == FP) & ~rows_fallback

        n = len(tier)
        dev = decision.device
        lookup = r.ledger_lookup(tier)
        row_of = torch.arange(B * H, device=dev).view(B, H, 1)
        counted = TierCounters()

        def ledger_index(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
            b, h, l = torch.nonzero(mask, as_tuple=True)
            p = r.fp.positions[b, h, l]
            return lookup[(b * H + h) * Wn + window_of(p, r.origin[b], w)], p, (b, h, l)

        new_pos = torch.full((n, w), -1, dtype=tier.positions.dtype, device=dev)
        new_mod = tier.modality.clone()
        new_state = {k: v.clone() for k, v in tier.state.items()}
        if n:
            s = slot[stay]
            new_pos.view(-1)[s] = tier.positions.view(-1)[s]
        li, p, (b, h, l) = ledger_index(demote)
        reused = li >= 0
        if bool(reused.any()):
            at = li[reused] * w + (p[reused] - r.origin[b[reused]]) % w  # the entry's slot in its window
            new_pos.view(-1)[at] = p[reused].to(new_pos.dtype)
            new_mod.view(-1)[at] = r.fp.modality[b, h, l][reused]
            for k in new_state:
                new_state[k].view(-1)[at] = r.fp.state[k][b, h, l][reused]
        has_fp = torch.zeros(n, dtype=torch.bool, device=dev)
        kli, _, _ = ledger_index(keep_fp)
        has_fp[kli[kli >= 0]] = True
        if n:
            has_fp[slot[promote] // w] = True
        active = (new_pos >= 0).any(dim=1)
        # a window quantized early in this event exists only because this event sends some of its
        # entries to INT2: it stays if one is (a ledgered window also stays dormant for its FP ones)
        provisional = r.provisional[r.window_keys(tier)] if r.provisional is not None and n else None
        dormant_ok = has_fp if provisional is None else has_fp & ~provisional
        keep = (active | dormant_ok) & ~fallback.reshape(-1)[tier.row] if n else active

        # fresh windows: quantized from every entry they still hold (FP ones too, so that those can be
        # demoted later through the same codes); only the demoted slots are attended
        fresh_windows = None
        fresh = ~reused
        if bool(fresh.any()):
            fresh_key = torch.unique(((b * H + h) * Wn + window_of(p, r.origin[b], w))[fresh])
            all_key = (row_of * Wn + r.window_ids(r.fp.positions))
            members = (keep_fp | demote) & torch.isin(all_key, fresh_key)
            win = gather_windows(r.fp, r.source, members, w, Wn, layer.store.state_names, r.origin, tier.rope,
                                 keep_original=tier.spill is not None)
            demoted_key = (((b * H + h) * Wn) * w + p)[fresh]  # row * Wn * w + position
            slot_key = ((win.row * Wn)[:, None] * w + win.positions.long())
            attended = (win.positions >= 0) & torch.isin(slot_key, demoted_key)
            fresh_windows = FreshWindows(win, torch.where(attended, win.positions, torch.full_like(win.positions, -1)))
            counted.quantized += len(fresh_key)
            counted.demotions += len(fresh_key)
        if bool(reused.any()):
            touched = torch.unique(li[reused])  # windows taking entries back through their stored codes
            if provisional is not None:
                touched = touched[~provisional[touched]]
            counted.ledger_reuses += touched.numel()
            counted.demotions += touched.numel()
        promoted = slot[promote]
        if n:
            counted.promotions += int(torch.unique(promoted // w).numel())
            if provisional is None:
                counted.evicted_windows += int((tier.active & ~keep).sum())
            else:  # the early windows this event keeps count as the fresh quantizations they stand for
                counted.evicted_windows += int((tier.active & ~keep & ~provisional).sum())
                counted.quantized += int((keep & provisional).sum())
                counted.demotions += int((keep & provisional).sum())
        kept = torch.nonzero(keep).flatten()
        refreshed = None
        if kept.numel():
            refreshed = RefreshedSlots(index=torch.arange(kept.numel(), device=dev), positions=new_pos[kept],
                                       modality=new_mod[kept], state={k: v[kept] for k, v in new_state.items()})
        return LayerMoves(layer, keep_fp, keep, active, refreshed, promoted, fresh_windows, counted)

    @staticmethod
    def _carry_out(moves: "LayerMoves", codes: QuantizedWindows | None) -> None:
        """Rebuild the layer's tier and FP store as ``moves`` says; ``codes``: its fresh windows'."""
        store, tier = moves.layer.store, moves.layer.tier
        new_windows = None
        if moves.fresh is not None:
            win = moves.fresh.windows
            new_windows = NewWindows(
                codes=codes, row=win.row, window_id=win.window_id, positions=moves.fresh.attended,
                modality=win.modality, state=win.state,
                spill=SpillCopies.from_device(win.original_keys, win.values, tier.pin_spill) if tier.spill is not None else None,
            )
        insert = _promoted_slots(tier, moves.promoted, store.state_names)
        tier.counters.add(moves.counted)
        tier.rebuild(moves.keep, moves.active, moves.refreshed, new_windows)
        store.compact(moves.keep_fp, insert=insert)


@dataclass
class FreshWindows:
    """Windows an event quantizes for the first time: every entry they hold, and which slots are attended."""

    windows: WindowEntries
    attended: torch.Tensor  # [n, w] int32 positions of the demoted slots, -1 elsewhere


@dataclass
class LayerMoves:
    """One layer's routing decisions worked out, before its fresh windows are quantized."""

    layer: RoutedLayer
    keep_fp: torch.Tensor                 # [B, H, Lf] FP entries that stay FP
    keep: torch.Tensor                    # [n] ledger windows kept (active or dormant)
    active: torch.Tensor                  # [n] ledger windows attended after the event
    refreshed: RefreshedSlots | None      # new metadata of the kept windows
    promoted: torch.Tensor                # INT2 slots (ledger index * w + slot) promoted to FP
    fresh: FreshWindows | None            # windows to quantize, or None
    counted: TierCounters                 # what the moves add to the tier's counters


def _quantize_fresh(moves: Sequence[LayerMoves]) -> list[QuantizedWindows | None]:
    """Codes of each layer's fresh windows (None where it has none): one call for all the layers
    whose tiers quantize like the first one's, one call each for any other."""
    out: list[QuantizedWindows | None] = [None] * len(moves)
    todo = [i for i, m in enumerate(moves) if m.fresh is not None]
    if not todo:
        return out
    first = moves[todo[0]].layer.tier
    dtype = moves[todo[0]].fresh.windows.keys.dtype
    together = [i for i in todo if moves[i].layer.tier.quantizes_like(first)
                and moves[i].fresh.windows.keys.dtype == dtype and moves[i].fresh.windows.values.dtype == dtype]
    if len(together) > 1:
        keys = torch.cat([moves[i].fresh.windows.keys for i in together])
        values = torch.cat([moves[i].fresh.windows.values for i in together])
        parts = first.quantize(keys, values).split([moves[i].fresh.windows.keys.shape[0] for i in together])
        for i, codes in zip(together, parts):
            out[i] = codes
    for i in todo:
        if out[i] is None:
            win = moves[i].fresh.windows
            out[i] = moves[i].layer.tier.quantize(win.keys, win.values)
    return out


def _promoted_slots(tier: Int2Tier, slots: torch.Tensor, state_names: tuple[str, ...]) -> Entries | None:
    """Entries of single promoted INT2 slots (ledger index * w + slot): their original copies
    from the spill tier when it is on, else their dequantized codes."""
    if slots.numel() == 0:
        return None
    w = tier.window
    windows, inverse = torch.unique(slots // w, return_inverse=True)
    s = slots % w
    if tier.spill is not None:
        keys, values = tier.spill.restore(windows, tier.device)
    else:
        keys, values = tier.dequantize(windows)
    keys, values = keys[inverse, s], values[inverse, s]
    pos = tier.positions.view(-1)[slots]
    return Entries(
        rows=tier.row[slots // w], keys=keys, values=values, positions=pos,
        modality=tier.modality.view(-1)[slots],
        state={n: tier.state[n].view(-1)[slots] for n in state_names},
    )
