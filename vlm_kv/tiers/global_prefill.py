"""A global ranking's prefill routing, started layer by layer (dbtrimkv + tiers; issue 25).

Under a global allocation the gates' scores of every layer share one ranking per sequence, so no
layer's FP set is known before the last layer has run, and the routing event waits for the end of
the forward. Two things are known earlier, and both act at once:

* **who can no longer be FP.** The event keeps at most ``K = budget bytes / bytes per entry``
  unprotected entries of a sequence in FP (each costs at least its bytes), so once ``K``
  unprotected entries of the layers seen so far score strictly higher than an entry, that entry
  ends in INT2 or evicted, whatever later layers bring (they only add competitors). It leaves the
  FP store right away, into its window's INT2 codes. The window is quantized from every entry it
  holds at that moment, which is what the event would quantize it from (under the entry router an
  INT2 window keeps all its non-FP entries), and no entry of it has left the store before.
* **which windows can no longer be INT2.** At most ``S = budget bytes / window bytes`` windows
  take INT2. A window's score at the event reduces its non-FP entries (``max`` or ``logsumexp``:
  more entries, higher score), so it lies between the reduction over its entries already out of
  FP and over all its unprotected entries. A window whose upper bound is below the lower bounds
  of ``S + 1`` others is evicted by the event; its entries out of FP are dropped now. (With
  ``S + 1`` windows certain to hold non-FP entries, the event cannot take its "everything fits
  in INT2" rule, and those windows keep outranking every dropped one: the INT2 set is the one
  routing at the end chooses.)

The event then ranks and charges the windows quantized early as fresh ones
(``LayerRouting.provisional``) and drops those it does not send to INT2, so its decisions, codes
and logits are those of routing everything at the end (``tests/cache/test_tiered_prefill.py``).
Only windows the ledger did not hold when the forward began take part (a ledgered window's codes
and charges are the event's own business), and only scorers whose scores are a function of each
entry's state and position (the same in either tier). What stays in FP meanwhile is the top ``K``
and the protected entries; what stays in INT2, about the budget's windows (docs/tiered_prefill.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vlm_kv.tiers.routing import LayerRouting, RoutedLayer, RouterStrategy
from vlm_kv.tiers.windows import EVICT, FP, INT2, reduce_windows
from vlm_kv.tiers.int2_tier import TierCounters

if TYPE_CHECKING:
    from vlm_kv.tiers.window_router import _Event

__all__ = ["GlobalPrefillRouting"]

# a window is dropped only when its upper bound is below the others' lower bounds by more than the
# rounding of two float64 reductions of the same scores taken in another order
_MARGIN = 1e-9


@dataclass
class _LayerEntries:
    """A layer's unprotected entries outside ledgered windows, fixed once the layer has run."""

    key: torch.Tensor        # [N] flat window, row * Wn + window id
    score: torch.Tensor      # [N]
    batch: torch.Tensor      # [N] sequence
    upper: torch.Tensor      # [B * H * Wn] float64: the window's reduction over all of them
    ledgered: torch.Tensor   # [B * H * Wn] windows the ledger held when the forward began
    windows_per_row: int     # Wn
    counters: TierCounters   # the layer's tier counters before the event
    before: int              # entries the layer held before the event
    reduce: str


class GlobalPrefillRouting:
    """A global ranking's prefill event in flight: after each layer's attention, entries that can no
    longer be FP go to INT2, or out when their window can no longer be INT2 (``after_layer``); the
    event itself runs at the end of the forward over every layer, with the windows quantized early
    marked (``event_routings``)."""

    def __init__(self, event: "_Event", strategy: RouterStrategy, window: int) -> None:
        self.event = event
        self.strategy = strategy
        self.window = window
        caps = [event.layer_capacity(i) for i in range(event.num_layers)]
        self.capacity_tokens = torch.stack(caps).sum(dim=0)  # [B] tokens per head over all layers
        self.k: torch.Tensor | None = None           # [B] FP entries the budget pays for at most
        self.window_bytes = 0                        # b_q
        self.share: torch.Tensor | None = None       # [B] the event's INT2 share q
        self.forced_seen: torch.Tensor | None = None  # [B] protected entries of the layers seen
        self.bytes_per_entry: int | None = None
        self.num_kv_heads: int | None = None
        self.best: list[torch.Tensor] = []            # per sequence: the K best unprotected scores so far
        self.threshold: torch.Tensor | None = None   # [B] K-th best score (-inf until K are seen)
        self.layers: dict[int, RoutedLayer] = {}
        self.entries: dict[int, _LayerEntries] = {}
        self.dropped: dict[int, torch.Tensor] = {}   # layer -> [B * H * Wn] windows that cannot be INT2
        self.lowest: dict[int, torch.Tensor] = {}    # layer -> [B] lowest score still in FP and movable
        self._competitors: tuple[torch.Tensor, torch.Tensor] | None = None  # the newest layer's, until counted

    @property
    def before(self) -> dict[int, int]:
        return {idx: e.before for idx, e in self.entries.items()}

    # ------------------------------------------------------------ after each layer's attention
    @torch.no_grad()
    def after_layer(self, layer: RoutedLayer) -> None:
        routing = self.event.routing(layer, self.window)
        self._first_sight(layer, routing)
        self._raise_threshold()
        newly_dropped = self._drop_windows()
        for idx, other in self.layers.items():
            fresh = idx == layer.layer_idx
            if fresh or bool((self.lowest[idx] < self.threshold).any()) or newly_dropped.get(idx, False):
                r = routing if idx == layer.layer_idx else self.event.routing(other, self.window)
                self._move(other, r)

    def _first_sight(self, layer: RoutedLayer, routing: LayerRouting) -> None:
        idx = layer.layer_idx
        if idx in self.layers:
            raise RuntimeError(f"layer {idx} attended twice in one prefill forward")
        B, H = routing.scores.shape[:2]
        device, dtype = routing.scores.device, routing.scores.dtype
        if self.k is None:
            self.bytes_per_entry, self.num_kv_heads = layer.store.bytes_per_entry, H
            self.k = self.capacity_tokens.to(device) * H
            self.window_bytes = layer.tier.window_bytes()
            self.share = self.strategy.config.share_for(routing.budget_fraction).double()  # [B] INT2 share q
            self.forced_seen = torch.zeros(B, dtype=torch.long, device=device)
            self.best = [torch.empty(0, dtype=dtype, device=device) for _ in range(B)]
            self.threshold = torch.full((B,), float("-inf"), dtype=dtype, device=device)
        elif layer.store.bytes_per_entry != self.bytes_per_entry or H != self.num_kv_heads:
            # K counts entries: with layers of different entry sizes it would not bound the FP set
            raise RuntimeError("a global tiered prefill needs every layer's entries to have one size")
        size = B * H * max(routing.num_windows, 1)
        ledgered = torch.zeros(size, dtype=torch.bool, device=device)
        if len(layer.tier):
            ledgered[routing.window_keys(layer.tier)] = True
        keys = self._keys(routing)
        forced = routing.forced(layer.seen)
        unprotected = routing.valid & ~forced
        self.forced_seen += forced.flatten(1).sum(dim=1)
        self._competitors = (routing.scores[unprotected], keys[unprotected] // (H * max(routing.num_windows, 1)))
        mine = unprotected & ~ledgered[keys]
        reduce = self.event.scorer.for_layer(idx).window_reduce
        key, score = keys[mine], routing.scores[mine]
        self.layers[idx] = layer
        self.entries[idx] = _LayerEntries(
            key=key, score=score, batch=key // (H * max(routing.num_windows, 1)), windows_per_row=max(routing.num_windows, 1),
            upper=reduce_windows(score, key, size, reduce), ledgered=ledgered,
            counters=dataclasses.replace(layer.tier.counters), before=layer.num_entries(), reduce=reduce)
        self.dropped[idx] = torch.zeros(size, dtype=torch.bool, device=device)

    @staticmethod
    def _keys(routing: LayerRouting) -> torch.Tensor:
        """[B, H, Lf + Lq] each entry's flat window (padding lands in a row's window 0)."""
        B, H = routing.scores.shape[:2]
        row = torch.arange(B * H, device=routing.scores.device).view(B, H, 1)
        return row * max(routing.num_windows, 1) + routing.window_ids(routing.positions)

    def _raise_threshold(self) -> None:
        """Add the newest layer's unprotected scores (ledgered windows' too: they compete, though
        they never move early) to each sequence's K best; the K-th is the threshold."""
        scores, batch = self._competitors
        for b in range(len(self.best)):
            k = int(self.k[b])
            pool = torch.cat([self.best[b], scores[batch == b]])
            if pool.numel() > k:
                pool = torch.topk(pool, k).values if k else pool[:0]
            self.best[b] = pool
            if pool.numel() >= k:
                self.threshold[b] = pool.min() if k else float("inf")
        self._competitors = None

    def _drop_windows(self) -> dict[int, bool]:
        """Mark the windows that can no longer be INT2; returns, per layer, whether any was added.

        With ``F`` the most the event's groups can route (budget minus the protected entries seen),
        the event's INT2 windows number at most ``S = (q F + b_tok + b_q) / b_q`` (its FP entries
        take ``(1 - q) F`` less at most one entry's cost), and it can keep every non-FP entry only
        if at most ``F / b_q`` windows hold one. A window goes when ``S + 1`` others outrank it
        for sure, and only while ``F / b_q + 1`` windows holding entries out of FP remain."""
        if any(e.reduce not in ("max", "logsumexp") for e in self.entries.values()):
            return {}  # the bounds need a reduction that grows with its entries
        lower, upper, where = [], [], []
        for idx, e in self.entries.items():
            out = e.score < self.threshold[e.batch]
            low = reduce_windows(e.score[out], e.key[out], e.upper.numel(), e.reduce)
            ids = torch.nonzero(torch.isfinite(low) & ~self.dropped[idx]).flatten()
            lower.append(low[ids])
            upper.append(e.upper[ids])
            where.append((idx, ids))
        low, up = torch.cat(lower), torch.cat(upper)
        batch = torch.cat([ids // (self.num_kv_heads * self.entries[idx].windows_per_row) for idx, ids in where])
        b_tok, b_q = self.bytes_per_entry, self.window_bytes
        routable = (self.k - self.forced_seen) * b_tok  # F
        share = self.share.to(low.device)
        drop = torch.zeros_like(low, dtype=torch.bool)
        for b in range(routable.numel()):
            F = int(routable[b])
            if F < 0:
                continue  # the event falls back to its entry rule for this sequence
            mine = torch.nonzero(batch == b).flatten()
            most_int2 = int((float(share[b]) * F + b_tok + b_q) // b_q)
            keep_at_least = F // b_q + 1
            if mine.numel() <= max(most_int2, keep_at_least - 1):
                continue
            cut = torch.topk(low[mine], most_int2 + 1).values[-1]
            hi = up[mine]
            out = torch.nonzero(hi + _MARGIN * (1 + hi.abs()) < cut).flatten()
            allowed = mine.numel() - keep_at_least
            if out.numel() > allowed:
                out = out[torch.argsort(hi[out])[:allowed]]  # the lowest first
            drop[mine[out]] = True
        added, start = {}, 0
        for idx, ids in where:
            n = ids.numel()
            chosen = ids[drop[start : start + n]]
            start += n
            added[idx] = bool(chosen.numel())
            self.dropped[idx][chosen] = True
        return added

    def _move(self, layer: RoutedLayer, routing: LayerRouting) -> None:
        """Carry out what is known for one layer: FP entries below the threshold to INT2 (or out,
        with their window), INT2 entries of windows that can no longer be INT2 out."""
        idx = layer.layer_idx
        e = self.entries[idx]
        Lf = routing.fp.length
        keys = self._keys(routing)
        movable = routing.valid & ~routing.forced(layer.seen) & ~e.ledgered[keys]
        movable[..., Lf:] = False  # INT2 entries stay, unless their window is dropped
        below = movable & (routing.scores < self.threshold.view(-1, 1, 1))
        dropped = self.dropped[idx][keys]
        self.lowest[idx] = routing.scores.masked_fill(~(movable & ~below), float("inf")).flatten(1).amin(dim=1)
        decision = torch.where(below, torch.where(dropped, EVICT, INT2), FP)
        decision[..., Lf:] = torch.where(dropped[..., Lf:], EVICT, INT2)
        changes = below.any() or (routing.valid[..., Lf:] & dropped[..., Lf:]).any()
        if not bool(changes):
            return
        routing = self._with_provisional(layer, routing)
        fallback = torch.zeros(routing.scores.shape[:2], dtype=torch.bool, device=routing.scores.device)
        self.strategy.apply(layer, routing, decision, fallback)

    # ------------------------------------------------------------ the event
    def event_routings(self, layers: Sequence[RoutedLayer]) -> list[LayerRouting]:
        """The end-of-forward event's routings, each with the windows quantized early marked
        (``provisional``); the layers' tier counters go back to what they were before the
        forward, since the event counts its moves itself."""
        out = []
        for layer in layers:
            r = self.event.routing(layer, self.window)
            e = self.entries.get(layer.layer_idx)
            if e is not None:
                layer.tier.counters = e.counters
                r = self._with_provisional(layer, r)
            out.append(r)
        return out

    def _with_provisional(self, layer: RoutedLayer, routing: LayerRouting) -> LayerRouting:
        """``routing`` with the layer's windows quantized in this event marked (those the ledger
        did not hold when the forward began)."""
        ledgered = self.entries[layer.layer_idx].ledgered
        early = torch.zeros_like(ledgered)
        if len(layer.tier):
            early[routing.window_keys(layer.tier)] = True
        return dataclasses.replace(routing, provisional=early & ~ledgered)
