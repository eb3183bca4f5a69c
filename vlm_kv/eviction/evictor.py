"""Eviction steps: when they run, what each sequence may keep, which entries stay.

An eviction step runs after every forward with several tokens (a prefill, a prefill chunk, a
new turn) and every ``evict_every`` decode steps. It turns the budget into per-head capacities,
asks the scorer for every layer's scores, protects sinks and the recent window, lets the
allocation choose the kept entries, and compacts each layer's store.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from vlm_kv.config import Budget
from vlm_kv.policies.base import ScoreContext, Scorer, protect, protected_counts
from vlm_kv.storage.allocation import Allocation, GlobalTopK
from vlm_kv.storage.ledger import TokenLedger
from vlm_kv.storage.ordering import descending_order
from vlm_kv.storage.store import PaddedView, VarlenKVStore


class EvictedLayer(Protocol):
    """What an eviction step reads of a cache layer: its store and what its scorer's context needs."""

    layer_idx: int
    seen: int
    scaling: float | None
    store: VarlenKVStore
    window_queries: torch.Tensor | None   # [B, Hq, w, D] the layer's recent queries
    window_positions: torch.Tensor | None


class Evictor:
    def __init__(
        self,
        scorer: Scorer,
        allocation: Allocation,
        budget: Budget,
        evict_every: int = 16,
        slack: int = 0,
        seed: int = 0,
    ) -> None:
        if evict_every < 1:
            raise ValueError(f"evict_every must be >= 1, got {evict_every}")
        if slack < 0:
            raise ValueError(f"slack must be >= 0, got {slack}")
        self.scorer = scorer
        self.allocation = allocation
        self.budget = budget
        self.evict_every = evict_every
        self.slack = slack
        self.seed = seed
        self.generators: list[torch.Generator] = []  # one per sequence, for random draws
        self.decode_steps_since_eviction = 0
        self.eviction_steps = 0
        self.evicted_entries = 0
        self.phase = "prefill"  # what the forward before the next eviction step was


    def due(self, q_len: int, prompt: bool = False) -> bool:
        """Whether the forward that just brought ``q_len`` tokens ends with an eviction step.
        ``prompt``: the forward started on an empty cache; a prompt is a prefill even when it is one
        token long (a padded batch prefills it with its longer rows, so it must be alone too)."""
        if q_len > 1 or prompt:
            self.phase = "prefill"
            return True
        self.phase = "decode"
        self.decode_steps_since_eviction += q_len
        return self.decode_steps_since_eviction >= self.evict_every

    def row_generators(self, batch: int) -> list[torch.Generator]:
        """A generator per sequence, each seeded alike: a sequence's random draws never depend on
        what else is in its batch."""
        while len(self.generators) < batch:
            self.generators.append(torch.Generator().manual_seed(self.seed))
        return self.generators[:batch]

    def repeat_batch(self, repeats: int) -> None:
        """Sequence b becomes b*repeats .. b*repeats+repeats-1; each copy continues b's draws."""
        def copy(generator: torch.Generator) -> torch.Generator:
            clone = torch.Generator()
            clone.set_state(generator.get_state())
            return clone

        self.generators = [copy(g) for g in self.generators for _ in range(repeats)]

    def capacities(self, valid_tokens: torch.Tensor) -> torch.Tensor:
        """[B] tokens per head each sequence keeps after an eviction step (budget minus slack)."""
        caps = [max(0, self.budget.capacity(int(n)) - self.slack) for n in valid_tokens.tolist()]
        return torch.tensor(caps, dtype=torch.long, device=valid_tokens.device)

    def protected(self, caps: torch.Tensor, scorer: Scorer) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [protected_counts(scorer, int(c)) for c in caps.tolist()]
        sinks = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=caps.device)
        windows = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=caps.device)
        return sinks, windows

    def layer_scores(self, scorer: Scorer, layer: EvictedLayer, view: PaddedView, cap_layer: torch.Tensor,
                     ledger: TokenLedger, num_layers: int) -> torch.Tensor:
        scorer = scorer.for_layer(layer.layer_idx)
        ctx = ScoreContext(
            layer_idx=layer.layer_idx,
            num_layers=num_layers,
            view=view,
            window_queries=layer.window_queries,
            window_positions=layer.window_positions,
            scaling=layer.scaling,
            seen=layer.seen,
            capacity=cap_layer,
            generator=self.row_generators(view.valid.shape[0]),
        )
        if view.length == 0:  # everything was evicted before (a budget of 0 tokens per head)
            return torch.empty(view.valid.shape, dtype=torch.float32, device=view.valid.device)
        sinks, windows = self.protected(cap_layer, scorer)
        return protect(scorer.score(ctx), view, sinks, windows, ledger.first_positions, layer.seen)

    def begin_step(self, ledger: TokenLedger) -> tuple[torch.Tensor, Scorer, Allocation]:
        """Start an eviction (or routing) step: per-sequence capacities, and the step's scorer and allocation."""
        self.decode_steps_since_eviction = 0
        caps = self.capacities(ledger.valid_tokens)
        return caps, self.scorer.for_phase(self.phase), self.allocation.for_step(self.phase, ledger.valid_tokens)

    def end_step(self, entries_before: int, entries_after: int) -> None:
        self.eviction_steps += 1
        self.evicted_entries += entries_before - entries_after

    def global_scores(self, scorer: Scorer, layer: EvictedLayer, caps: torch.Tensor, ledger: TokenLedger,
                      num_layers: int) -> tuple[torch.Tensor, PaddedView]:
        """One layer's scores for a global allocation (every layer at the sequence's capacity), and the view."""
        view = layer.store.padded_view(with_values=False, states=self.scorer.state_names)
        return self.layer_scores(scorer, layer, view, caps, ledger, num_layers), view

    def keep_layer(self, scorer: Scorer, step_allocation: Allocation, layer: EvictedLayer, caps: torch.Tensor,
                   ledger: TokenLedger, num_layers: int) -> torch.Tensor:
        """Keep mask of one layer under a per-layer (not global) allocation."""
        allocation = step_allocation.for_layer(layer.layer_idx)
        window = self.protected(caps, scorer.for_layer(layer.layer_idx))[1]  # each sequence's own, never the batch's
        cap_layer = allocation.layer_capacity(layer.layer_idx, num_layers, caps, window)
        view = layer.store.padded_view(with_values=False, states=self.scorer.state_names)
        return allocation.keep_layer(self.layer_scores(scorer, layer, view, cap_layer, ledger, num_layers), cap_layer)

    @torch.no_grad()
    def evict(self, layers: Sequence[EvictedLayer], ledger: TokenLedger) -> None:
        """One eviction step over every layer; afterwards the cache holds at most its budget."""
        caps, scorer, step_allocation = self.begin_step(ledger)
        before = sum(layer.store.num_entries() for layer in layers)
        num_layers = len(layers)
        if step_allocation.is_global:
            scored = [self.global_scores(scorer, layer, caps, ledger, num_layers) for layer in layers]
            keeps = step_allocation.keep_all([sc for sc, _ in scored], caps, [view.modality for _, view in scored])
        else:
            keeps = [self.keep_layer(scorer, step_allocation, layer, caps, ledger, num_layers) for layer in layers]
        for layer, keep in zip(layers, keeps):
            layer.store.compact(keep)
        self.end_step(before, sum(layer.store.num_entries() for layer in layers))

    # ------------------------------------------------------------ layer by layer, during a prefill
    def begin_layerwise(self, ledger: TokenLedger, num_layers: int) -> "LayerwiseStep | None":
        """A prefill's eviction step taken layer by layer (right after each layer's attention),
        or None where this step cannot be split by layer (global allocations with floors or
        caps, or over scores that depend on neighbouring entries; threshold allocations)."""
        self.phase = "prefill"
        caps, scorer, step_allocation = self.begin_step(ledger)
        if step_allocation.is_global:
            plain = isinstance(step_allocation, GlobalTopK) and step_allocation.is_plain
            # an entry dropped early changes its neighbours' pooled scores (``score_is_per_entry``)
            per_entry = all(scorer.for_layer(i).score_is_per_entry for i in range(num_layers))
            if not (plain and per_entry):
                return None
        return LayerwiseStep(caps, scorer, step_allocation, num_layers)

    @torch.no_grad()
    def evict_layer(self, step: "LayerwiseStep", layer: EvictedLayer, ledger: TokenLedger) -> None:
        """Evict from one layer what the step will not keep, as soon as its attention has run."""
        entries = layer.store.num_entries()
        if step.allocation.is_global:
            scores, _ = self.global_scores(step.scorer, layer, step.caps, ledger, step.num_layers)
            keep = step.never_dropped(scores, step.caps * (step.num_layers * scores.shape[1]))
            step.dropped += entries - int(keep.sum())
        else:
            keep = self.keep_layer(step.scorer, step.allocation, layer, step.caps, ledger, step.num_layers)
            step.done[layer.layer_idx] = entries
        layer.store.compact(keep)

    @torch.no_grad()
    def finish_layerwise(self, step: "LayerwiseStep", layers: Sequence[EvictedLayer], ledger: TokenLedger) -> None:
        """End of the prefill: a global step now chooses exactly among what is left; a per-layer
        step evicts the layers that did not attend (if any) and closes the step."""
        if step.allocation.is_global:
            self.evict(layers, ledger)
            self.evicted_entries += step.dropped
            return
        before = 0
        for layer in layers:
            if layer.layer_idx in step.done:
                before += step.done[layer.layer_idx]
            else:
                before += layer.store.num_entries()
                layer.store.compact(self.keep_layer(step.scorer, step.allocation, layer, step.caps, ledger, step.num_layers))
        self.end_step(before, sum(layer.store.num_entries() for layer in layers))


class LayerwiseStep:
    """A prefill's eviction step, taken one layer at a time so that the prompt's full keys and
    values never sit in every layer at once: peak KV during a prefill is the budget plus about
    one layer, not the whole prompt.

    A per-layer allocation decides each layer from its own scores, so evicting a layer right
    after its attention keeps exactly what the end-of-forward step would. A global top-k of
    ``K`` entries cannot decide before it has seen every layer, but it can drop what will never
    make it: an entry scoring below the K-th best score seen so far stays below the K-th best
    over all layers. Those entries go at once; the end-of-forward step then takes the exact
    global choice among what is left (the same choice, since nothing it would keep was dropped).
    """

    def __init__(self, caps: torch.Tensor, scorer: Scorer, allocation: Allocation, num_layers: int) -> None:
        self.caps, self.scorer, self.allocation, self.num_layers = caps, scorer, allocation, num_layers
        self.done: dict[int, int] = {}          # layer -> entries it held before its eviction
        self.dropped = 0                        # entries a global step dropped early
        self._best: torch.Tensor | None = None  # [B, <= max K] best scores seen so far, descending

    def never_dropped(self, scores: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Mask of the entries of ``scores`` ([B, H, L]) that may still be among the ``k[b]`` best of
        sequence ``b`` once every layer is scored: those >= the k-th best score seen so far."""
        b = scores.shape[0]
        flat = scores.reshape(b, -1)
        pool = flat if self._best is None else torch.cat([self._best, flat], dim=1)
        ordered = pool.gather(1, descending_order(pool))
        kmax = int(k.max()) if k.numel() else 0
        self._best = ordered[:, :kmax]
        index = (k - 1).clamp(min=0, max=ordered.shape[1] - 1).view(b, 1)
        kth = ordered.gather(1, index).view(b)
        enough = (k >= 1) & (k <= ordered.shape[1])
        threshold = torch.where(enough, kth, torch.full_like(kth, float("-inf")))
        threshold = torch.where(k < 1, torch.full_like(kth, float("inf")), threshold)
        return (scores >= threshold.view(b, 1, 1)) & (scores > float("-inf"))
