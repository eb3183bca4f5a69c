"""Eviction steps: when they run, what each sequence may keep, which entries stay.

An eviction step runs after every forward with several tokens (a prefill, a prefill chunk, a
new turn) and every ``evict_every`` decode steps. It turns the budget into per-head capacities,
asks the scorer for every layer's scores, protects sinks and the recent window, lets the
allocation choose the kept entries, and compacts each layer's store.
"""

from __future__ import annotations

from typing import Sequence

import torch

from vlm_kv.allocation import Allocation
from vlm_kv.budget import Budget
from vlm_kv.ledger import TokenLedger
from vlm_kv.policies.base import ScoreContext, Scorer, protect, protected_counts


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
        self.generator = torch.Generator().manual_seed(seed)
        self.decode_steps_since_eviction = 0
        self.eviction_steps = 0
        self.evicted_entries = 0
        self.phase = "prefill"  # what the forward before the next eviction step was


    def due(self, q_len: int) -> bool:
        """Whether the forward that just brought ``q_len`` tokens ends with an eviction step."""
        if q_len > 1:
            self.phase = "prefill"
            return True
        self.phase = "decode"
        self.decode_steps_since_eviction += q_len
        return self.decode_steps_since_eviction >= self.evict_every

    def capacities(self, valid_tokens: torch.Tensor) -> torch.Tensor:
        """[B] tokens per head each sequence keeps after an eviction step (budget minus slack)."""
        caps = [max(0, self.budget.capacity(int(n)) - self.slack) for n in valid_tokens.tolist()]
        return torch.tensor(caps, dtype=torch.long, device=valid_tokens.device)

    def protected(self, caps: torch.Tensor, scorer: Scorer) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [protected_counts(scorer, int(c)) for c in caps.tolist()]
        sinks = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=caps.device)
        windows = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=caps.device)
        return sinks, windows

    def layer_scores(self, scorer: Scorer, layer, view, cap_layer: torch.Tensor, ledger: TokenLedger,
                num_layers: int) -> torch.Tensor:
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
            generator=self.generator,
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

    @torch.no_grad()
    def evict(self, layers: Sequence, ledger: TokenLedger) -> None:
        """One eviction step over every layer; afterwards the cache holds at most its budget."""
        caps, scorer, step_allocation = self.begin_step(ledger)
        states = self.scorer.state_names
        before = sum(layer.store.num_entries() for layer in layers)
        num_layers = len(layers)
        if step_allocation.is_global:
            scores, modality = [], []
            for layer in layers:
                view = layer.store.padded_view(with_values=False, states=states)
                scores.append(self.layer_scores(scorer, layer, view, caps, ledger, num_layers))
                modality.append(view.modality)
            keeps = step_allocation.keep_all(scores, caps, modality)
        else:
            keeps = []
            for layer in layers:
                allocation = step_allocation.for_layer(layer.layer_idx)
                window = int(self.protected(caps, scorer.for_layer(layer.layer_idx))[1].max()) if caps.numel() else 0
                cap_layer = allocation.layer_capacity(layer.layer_idx, num_layers, caps, window)
                view = layer.store.padded_view(with_values=False, states=states)
                keeps.append(allocation.keep_layer(self.layer_scores(scorer, layer, view, cap_layer, ledger, num_layers), cap_layer))
        for layer, keep in zip(layers, keeps):
            layer.store.compact(keep)
        self.end_step(before, sum(layer.store.num_entries() for layer in layers))
