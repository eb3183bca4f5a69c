"""A global ranking's prefill routing, started layer by layer (dbtrimkv + tiers; issue 25).

Under a global allocation the gates' scores of every layer share one ranking per sequence, so no
layer's FP set is known before the last layer has run, and the routing event waits for the end of
the forward. What *is* known earlier is who can no longer be FP: the event keeps at most
``K = budget bytes / bytes per entry`` unprotected entries of a sequence in FP (each costs at
least its bytes), so once ``K`` unprotected entries of the layers seen so far score strictly
higher than an entry, that entry ends in INT2 or evicted, whatever later layers bring (they only
add competitors). Such an entry leaves the FP store right away, into its window's INT2 codes:

* the window is quantized from every entry it holds at that moment, which is what the event
  would quantize it from (under the entry router an INT2 window keeps all its non-FP entries, so
  its members are all its entries), and no entry of it has left the store before;
* the event then ranks and charges these *provisional* windows as fresh ones
  (``LayerRouting.provisional``), so its decisions, codes and logits are those of routing
  everything at the end (tested in ``tests/cache/test_tiered_prefill.py``); a provisional window
  the event does not send to INT2 is dropped.

Only windows the ledger did not hold when the forward began are quantized early (a ledgered
window's codes and charges are the event's own business), and only for scorers whose scores are a
function of each entry's state and position (recomputed identically for an entry in either tier).
The FP copies kept meanwhile are the top ``K`` and the protected entries: on SmolLM2 at 0.1 this
bounds the prefill's peak near 0.23x of the full cache in fp32 (docs/tiered_prefill.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from vlm_kv.tiers.routing import LayerRouting, RoutedLayer, RouterStrategy
from vlm_kv.tiers.windows import FP, INT2

if TYPE_CHECKING:
    from vlm_kv.tiers.window_router import _Event

__all__ = ["GlobalPrefillRouting"]


class GlobalPrefillRouting:
    """A global ranking's prefill event in flight: after each layer's attention, entries that can no
    longer be FP go to INT2 (``after_layer``); the event itself runs at the end of the forward, over
    every layer, with the windows quantized early marked (``provisional``)."""

    def __init__(self, event: "_Event", strategy: RouterStrategy, window: int) -> None:
        self.event = event
        self.strategy = strategy
        self.window = window
        caps = [event.layer_capacity(i) for i in range(event.num_layers)]
        self.capacity_tokens = torch.stack(caps).sum(dim=0)  # [B] tokens per head over all layers
        self.k: torch.Tensor | None = None           # [B] FP entries the budget pays for at most
        self.bytes_per_entry: int | None = None
        self.num_kv_heads: int | None = None
        self.best: list[torch.Tensor] = []            # per sequence: the K best unprotected scores so far
        self.threshold: torch.Tensor | None = None   # [B] K-th best score (-inf until K are seen)
        self.layers: dict[int, RoutedLayer] = {}
        self.ledgered: dict[int, torch.Tensor] = {}  # layer -> [B * H * Wn] windows held before the forward
        self.lowest: dict[int, torch.Tensor] = {}    # layer -> [B] lowest score still FP and demotable
        self.counters: dict[int, object] = {}        # layer -> its tier counters before the event
        self.before: dict[int, int] = {}             # layer -> entries it held before the event

    # ------------------------------------------------------------ after each layer's attention
    @torch.no_grad()
    def after_layer(self, layer: RoutedLayer) -> None:
        routing = self.event.routing(layer, self.window)
        self._first_sight(layer, routing)
        forced = routing.forced(layer.seen)
        self._raise_threshold(routing, routing.valid & ~forced)
        self._demote(layer, routing, forced)
        for idx, other in self.layers.items():  # earlier layers: the threshold may have passed more entries
            if idx != layer.layer_idx and bool((self.lowest[idx] < self.threshold).any()):
                r = self.event.routing(other, self.window)
                self._demote(other, r, r.forced(other.seen))

    def _first_sight(self, layer: RoutedLayer, routing: LayerRouting) -> None:
        if layer.layer_idx in self.layers:
            raise RuntimeError(f"layer {layer.layer_idx} attended twice in one prefill forward")
        B, H = routing.scores.shape[:2]
        if self.k is None:
            self.bytes_per_entry, self.num_kv_heads = layer.store.bytes_per_entry, H
            self.k = self.capacity_tokens.to(routing.scores.device) * H
            self.best = [torch.empty(0, dtype=routing.scores.dtype, device=routing.scores.device) for _ in range(B)]
            self.threshold = torch.full((B,), float("-inf"), dtype=routing.scores.dtype, device=routing.scores.device)
        elif layer.store.bytes_per_entry != self.bytes_per_entry or H != self.num_kv_heads:
            # K counts entries: with layers of different entry sizes it would not bound the FP set
            raise RuntimeError("a global tiered prefill needs every layer's entries to have one size")
        self.layers[layer.layer_idx] = layer
        self.before[layer.layer_idx] = layer.num_entries()  # early moves drop only the padding's entries
        self.counters[layer.layer_idx] = dataclasses.replace(layer.tier.counters)
        ledgered = torch.zeros(B * H * max(routing.num_windows, 1), dtype=torch.bool, device=routing.scores.device)
        if len(layer.tier):
            ledgered[routing.window_keys(layer.tier)] = True
        self.ledgered[layer.layer_idx] = ledgered

    def _raise_threshold(self, routing: LayerRouting, candidates: torch.Tensor) -> None:
        """Add a layer's unprotected scores to each sequence's K best; the K-th is the threshold."""
        for b in range(len(self.best)):
            k = int(self.k[b])
            pool = torch.cat([self.best[b], routing.scores[b][candidates[b]]])
            if pool.numel() > k:
                pool = torch.topk(pool, k).values if k else pool[:0]
            self.best[b] = pool
            if pool.numel() >= k:
                self.threshold[b] = pool.min() if k else float("inf")

    def _demote(self, layer: RoutedLayer, routing: LayerRouting, forced: torch.Tensor) -> None:
        """Send this layer's FP entries below the threshold (outside windows the ledger held) to INT2."""
        Lf = routing.fp.length
        row = torch.arange(routing.scores.shape[0] * routing.scores.shape[1], device=routing.scores.device)
        keys = row.view(routing.scores.shape[:2] + (1,)) * routing.num_windows + routing.window_ids(routing.positions)
        ledgered = self.ledgered[layer.layer_idx].reshape(-1)
        if keys.numel():
            ledgered = ledgered[keys.clamp(min=0, max=ledgered.numel() - 1)]
        else:
            ledgered = torch.zeros_like(routing.valid)
        movable = routing.valid & ~forced & ~ledgered
        movable[..., Lf:] = False  # INT2 entries stay where they are
        scores = routing.scores
        doomed = movable & (scores < self.threshold.view(-1, 1, 1))
        still = movable & ~doomed
        self.lowest[layer.layer_idx] = scores.masked_fill(~still, float("inf")).flatten(1).amin(dim=1)
        if not bool(doomed.any()):
            return
        decision = torch.where(doomed, INT2, FP)
        decision[..., Lf:] = INT2  # tier slots stay
        fallback = torch.zeros(routing.scores.shape[:2], dtype=torch.bool, device=scores.device)
        self.strategy.apply(layer, routing, decision, fallback)

    # ------------------------------------------------------------ the event
    def event_routings(self, layers: Sequence[RoutedLayer]) -> list[LayerRouting]:
        """The end-of-forward event's routings, each with the windows quantized early marked
        (``provisional``); the layers' tier counters go back to what they were before the
        forward, since the event counts its moves itself."""
        out = []
        for layer in layers:
            r = self.event.routing(layer, self.window)
            if layer.layer_idx in self.layers:
                layer.tier.counters = self.counters[layer.layer_idx]
                early = torch.zeros_like(self.ledgered[layer.layer_idx])
                if len(layer.tier):
                    early[r.window_keys(layer.tier)] = True
                r = dataclasses.replace(r, provisional=early & ~self.ledgered[layer.layer_idx])
            out.append(r)
        return out
