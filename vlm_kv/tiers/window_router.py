"""Routing events of the tiered cache: every window goes to FP, INT2 or out, under the byte budget.

At each routing event (the end of every prefill or prefill chunk, then every ``w`` decode steps)
each layer's entries, FP and INT2 alike, are scored together by the policy's scorer, and the
scores are summed per window (``Scorer.window_reduce``). Windows that hold a protected entry
(sinks, the recent zone) or are not complete yet stay FP. The others are ranked in one list per
*group* and routed by rank (QEvict):

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

from dataclasses import dataclass
from typing import Sequence

import torch

from vlm_kv.config import TierConfig
from vlm_kv.storage.allocation import HeadAdaptive, top_k_mask
from vlm_kv.storage.ledger import TokenLedger
from vlm_kv.storage.store import Entries, PaddedView
from vlm_kv.tiers import entry_router as token_routing
from vlm_kv.tiers.int2_tier import Int2Tier, NewWindows, SpillCopies
from vlm_kv.tiers.windows import (
    EVICT,
    FP,
    INT2,
    gather_windows,
    reduce_windows,
    row_groups,
    window_of,
    window_value,
)


def merge_views(fp: PaddedView, tier: PaddedView, sort: bool) -> tuple[PaddedView, torch.Tensor | None]:
    """FP and INT2 entries of a layer side by side per row ([B, H, Lf + Lq]); with ``sort`` in
    position order (scorers that smooth along positions need it), returning the permutation."""

    def cat(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cat([a, b.to(a.dtype)], dim=2)

    view = PaddedView(
        keys=cat(fp.keys, tier.keys),
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
        keys=gather(view.keys), values=view.values if not view.values.shape[-1] else gather(view.values),
        positions=gather(view.positions), modality=gather(view.modality),
        valid=gather(view.valid), state={n: gather(t) for n, t in view.state.items()},
    )
    return sorted_view, perm


def unsort(values: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Inverse of ``merge_views``' permutation for a [B, H, L] quantity."""
    return torch.empty_like(values).scatter_(-1, perm, values)


@dataclass
class _LayerRouting:
    """One layer's entries and windows at a routing event."""

    fp: PaddedView            # FP entries with values, store layout
    tier_slot: torch.Tensor   # [B, H, Lq] ledger slot of each INT2 entry (-1 empty)
    scores: torch.Tensor      # [B, H, Lf + Lq] protected +inf, empty -inf
    positions: torch.Tensor   # [B, H, Lf + Lq]
    valid: torch.Tensor
    num_windows: int          # windows per row (ceil(seen / w): the most any sequence has)
    cap: torch.Tensor         # [B] tokens per head this layer may hold
    origin: torch.Tensor      # [B] position of each sequence's first real token: where its windows start
    window: int               # tokens per window

    def window_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """Window id of [B, H, L] positions, counted from each sequence's origin."""
        return window_of(positions, self.origin.view(-1, 1, 1), self.window)

    def incomplete(self, wid: torch.Tensor, seen: int) -> torch.Tensor:
        """Windows some of whose positions are not seen yet ([B, H, L] ids)."""
        return (wid + 1) * self.window > seen - self.origin.view(-1, 1, 1)


class TierRouter:
    def __init__(self, config: TierConfig) -> None:
        self.config = config

    @torch.no_grad()
    def route(self, evictor, layers: Sequence, ledger: TokenLedger) -> None:
        """One routing event over every layer; afterwards the held bytes are within the budget."""
        caps, scorer, allocation = evictor.begin_step(ledger)
        before = sum(layer.num_entries() for layer in layers)
        w = self.config.window
        states = evictor.scorer.state_names
        num_layers = len(layers)
        routings = []
        for layer in layers:
            layer_scorer = scorer.for_layer(layer.layer_idx)
            window = evictor.protected(caps, layer_scorer)[1]  # each sequence's own, never the batch's
            cap_layer = allocation.for_layer(layer.layer_idx).layer_capacity(layer.layer_idx, num_layers, caps, window)
            fp = layer.store.padded_view(with_values=True, states=states)
            tv = layer.tier.view(states=states, with_values=False, dtype=fp.keys.dtype)
            merged, perm = merge_views(fp, tv.view, sort=True)
            scores = unsort(evictor.layer_scores(scorer, layer, merged, cap_layer, ledger, num_layers), perm)
            positions = torch.cat([fp.positions, tv.view.positions], dim=2)
            valid = torch.cat([fp.valid, tv.view.valid], dim=2)
            origin = ledger.first_positions.to(caps.device).clamp(max=layer.seen)
            routings.append(_LayerRouting(fp, tv.slot, scores, positions, valid, -(-layer.seen // w), cap_layer,
                                          origin, w))
        if self.config.fp_unit == "token":
            valid = ledger.valid_tokens.to(caps.device).clamp(min=1)
            share = self.config.share_for(caps.double() / valid.double())  # [B]
            decisions, fallback = token_routing.decide_entries(self.config, layers, routings, allocation, scorer,
                                                               share)
            for layer, r, dec, fb in zip(layers, routings, decisions, fallback):
                token_routing.apply_entries(self.config, layer, r, dec, fb)
        else:
            decisions, fallback = self._decide(layers, routings, allocation, scorer)
            for layer, r, dec, fb in zip(layers, routings, decisions, fallback):
                self._apply(layer, r, dec, fb)
        evictor.end_step(before, sum(layer.num_entries() for layer in layers))

    # ------------------------------------------------------------------ decisions
    def _decide(self, layers, routings, allocation, scorer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer: [B, H, Wn] decisions (FP / INT2 / EVICT) and [B, H] fallback rows."""
        mode = "global" if allocation.is_global else "layer" if isinstance(allocation, HeadAdaptive) else "row"
        device = routings[0].scores.device
        B, H = routings[0].scores.shape[:2]
        table = {k: [] for k in ("group", "score", "fp_cost", "forced", "layer", "index", "value")}
        row_bytes, row_group = [], []
        b_q = layers[0].tier.window_bytes()
        for li, (layer, r) in enumerate(zip(layers, routings)):
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
            exists = count > 0
            fp_cost = count * b_tok + ledger.long() * b_q
            ids = torch.nonzero(exists).flatten()
            groups_of_rows = row_groups(mode, li, B, H, device)
            row_group.append(groups_of_rows)
            table["group"].append(groups_of_rows[ids // Wn])
            table["score"].append(score[ids])
            if self.config.int2_value is not None:
                table["value"].append(window_value(score[ids], reduce))
            table["fp_cost"].append(fp_cost[ids])
            table["forced"].append(forced[ids])
            table["layer"].append(torch.full_like(ids, li))
            table["index"].append(ids)
            row_bytes.append(r.cap.view(B, 1).expand(B, H).reshape(-1) * b_tok)
        t = {k: torch.cat(v) for k, v in table.items() if v}
        groups = int(torch.cat(row_group).max()) + 1
        budget = torch.zeros(groups, dtype=torch.long, device=device).index_add_(0, torch.cat(row_group), torch.cat(row_bytes))
        forced_cost = torch.zeros(groups, dtype=torch.long, device=device).index_add_(0, t["group"], t["fp_cost"] * t["forced"])
        free = budget - forced_cost  # M - P per group
        fallback_group = free < 0

        decision = torch.full_like(t["group"], EVICT)
        decision[t["forced"]] = FP
        cand = torch.nonzero(~t["forced"]).flatten()
        if cand.numel():
            value = t["value"][cand] if "value" in t else None
            decision[cand] = self._route_candidates(t["group"][cand], t["score"][cand], t["fp_cost"][cand], free, b_q,
                                                    groups, value)
        in_fallback = fallback_group[t["group"]]
        decision[in_fallback & ~t["forced"]] = EVICT

        decisions, fallbacks = [], []
        for li, r in enumerate(routings):
            mine = t["layer"] == li
            dec = torch.full((B * H * r.num_windows,), EVICT, dtype=torch.long, device=device)
            dec[t["index"][mine]] = decision[mine]
            decisions.append(dec.view(B, H, r.num_windows))
            fallbacks.append(fallback_group[row_group[li]].view(B, H))
        return decisions, fallbacks

    def _route_candidates(self, group: torch.Tensor, score: torch.Tensor, cost: torch.Tensor, free: torch.Tensor,
                          b_q: int, groups: int, value: torch.Tensor | None = None) -> torch.Tensor:
        """Decisions for the routed (non-forced) windows, ranked per group by score."""
        if self.config.quantize_all:
            return torch.full_like(group, INT2)
        by_score = torch.argsort(score, descending=True, stable=True)
        order = by_score[torch.argsort(group[by_score], stable=True)]
        g, c = group[order], cost[order]
        n = torch.zeros(groups, dtype=torch.long, device=g.device).index_add_(0, g, torch.ones_like(g))
        start = torch.cumsum(n, 0) - n
        rank = torch.arange(g.numel(), device=g.device) - start[g]
        group_cost = torch.zeros(groups, dtype=torch.long, device=g.device).index_add_(0, g, c)
        # inclusive prefix cost within each group (the order is by group, then by rank)
        cum = torch.cumsum(c, 0) - (torch.cumsum(group_cost, 0) - group_cost)[g]
        all_fp = (group_cost <= free)[g]
        if value is not None:
            n_fp, n_q = self._split_by_value(g, rank, n, start, c, cum, value[order], free, b_q, groups)
        else:
            n_fp, n_q = self._split_by_share(g, rank, n, c, cum, free, b_q, groups)
        out = torch.where(rank < n_fp[g], FP, torch.where(rank < (n_fp + n_q)[g], INT2, EVICT))
        out = torch.where(all_fp, torch.full_like(out, FP), out)
        result = torch.empty_like(out)
        result[order] = out
        return result

    def _split_by_share(self, g: torch.Tensor, rank: torch.Tensor, n: torch.Tensor, c: torch.Tensor,
                        cum: torch.Tensor, free: torch.Tensor, b_q: int, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(n_fp, n_q) per group by rules 2 and 3 (the fixed INT2 share q)."""
        q = self.config.int2_share
        room = free[g].double()
        # rule 2: the most FP windows with every other window fitting as INT2
        fits = (cum + (n[g] - rank - 1) * b_q) <= room
        first_miss = torch.full((groups,), 2**62, dtype=torch.long, device=g.device)
        first_miss.scatter_reduce_(0, g[~fits], rank[~fits], reduce="amin")
        n_fit = torch.minimum(first_miss, n)
        fit_exists = (n * b_q <= free) & (q > 0)
        # rule 3: the spec's split
        fp_spec = cum <= (1.0 - q) * room
        n_spec = torch.zeros(groups, dtype=torch.long, device=g.device).index_add_(0, g, fp_spec.long())
        used = torch.zeros(groups, dtype=torch.long, device=g.device).index_add_(0, g, c * fp_spec)
        slots = torch.div((free - used).clamp(min=0), b_q, rounding_mode="floor") if q > 0 else torch.zeros_like(used)
        use_fit = fit_exists & (n_fit >= n_spec)
        n_fp = torch.where(use_fit, n_fit, n_spec)
        n_q = torch.where(use_fit, n - n_fit, slots)
        return n_fp, n_q

    def _split_by_value(self, g: torch.Tensor, rank: torch.Tensor, n: torch.Tensor, start: torch.Tensor,
                        c: torch.Tensor, cum: torch.Tensor, v: torch.Tensor, free: torch.Tensor, b_q: int,
                        groups: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(n_fp, n_q) per group maximizing FP value + int2_value * INT2 value within the bytes.

        Candidate k FP windows (the top k, k = each rank; all-FP is rule 1) leaves
        ``free - cost(top k)`` for INT2 windows of ``b_q`` bytes each, taken next in rank."""
        eps = float(self.config.int2_value)
        group_v = torch.zeros(groups, dtype=v.dtype, device=v.device).index_add_(0, g, v)
        cum_v = torch.cumsum(v, 0) - (torch.cumsum(group_v, 0) - group_v)[g]  # inclusive, within group
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
    def _apply(self, layer, r: _LayerRouting, decision: torch.Tensor, fallback: torch.Tensor) -> None:
        store, tier = layer.store, layer.tier
        w = self.config.window
        B, H, Wn = decision.shape
        Lf = r.fp.length
        fp_scores = r.scores[..., :Lf]
        fp_pos, fp_valid = r.fp.positions, r.fp.valid
        wid = r.window_ids(fp_pos).clamp(max=max(Wn - 1, 0))
        dec_fp = decision.gather(2, wid) if Wn else torch.full_like(fp_pos, EVICT)
        rows_fallback = fallback[..., None]
        keep_fp = fp_valid & (dec_fp == FP) & ~rows_fallback
        if bool(fallback.any()):
            # entry level: each fallback row keeps its best protected / pinned entries up to its capacity
            pinned = fp_valid & (dec_fp == FP)
            pick = top_k_mask(fp_scores.masked_fill(~pinned, float("-inf")), r.cap.view(-1, 1))
            keep_fp = keep_fp | (pick & pinned & rows_fallback)
        demote = fp_valid & (dec_fp == INT2) & ~rows_fallback

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
        demoted = gather_windows(r.fp, demote, w, Wn, store.state_names, r.origin, tier.rope, keep_original=spill)
        # which demoted windows have a dormant ledger entry: reuse its codes
        new_windows, refreshed = None, None
        keep = stay | keep_dormant | promote | reactivate
        active = stay | reactivate
        if demoted is not None:
            lookup = torch.full((B * H * max(Wn, 1),), -1, dtype=torch.long, device=decision.device)
            if n:
                lookup[tier.row * Wn + tier.window_id] = torch.arange(n, device=decision.device)
            ledger_idx = lookup[demoted.row * Wn + demoted.window_id]
            reused = ledger_idx >= 0
            if bool(reused.any()):
                kept_position = torch.cumsum(keep.long(), 0) - 1
                at = ledger_idx[reused]
                refreshed = {
                    "index": kept_position[at],
                    "positions": demoted.positions[reused],
                    "modality": demoted.modality[reused],
                    "state": {k: v[reused] for k, v in demoted.state.items()},
                }
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
