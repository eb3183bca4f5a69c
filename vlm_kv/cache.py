"""The compressed cache: a transformers ``Cache`` whose layers evict under a budget.

Lifecycle, as in transformers' cache_utils: each ``CompressedLayer`` lazily creates its store
on the first ``update``; ``update`` appends the new tokens and hands the layer to the
attention function, which attends over the store; after the last layer of a forward the cache
decides whether this is an eviction step (after every prefill, then every ``evict_every``
decode steps) and, if so, scores, allocates and compacts every layer.

Positions are never rewritten: ``get_seq_length`` counts every token seen, so the model's
RoPE / M-RoPE positions and ``cache_position`` stay those of the uncompressed run, while each
stored entry remembers its own original position.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from vlm_kv.allocation import Allocation
from vlm_kv.attention import hand_over, varlen_attention
from vlm_kv.budget import Budget, BudgetError
from vlm_kv.models.adapters import MODALITIES, ModelAdapter
from vlm_kv.policies.base import ScoreContext, Scorer, protect
from vlm_kv.storage import VarlenKVStore


class CacheMisuseError(RuntimeError):
    """The cache is used in a way it cannot honour (another model, beam search, cropping)."""


class CompressedLayer(CacheLayerMixin):
    """One decoder layer's compressed KV cache."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, cache: "CompressedCache", layer_idx: int) -> None:
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.store: VarlenKVStore | None = None
        self.seen = 0
        self.window_queries: torch.Tensor | None = None
        self.window_positions: torch.Tensor | None = None
        self.scaling: float | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.device = key_states.device
        self.store = VarlenKVStore(b, h, d, key_states.dtype, key_states.device, self.cache.scorer.state_names)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, _, q, _ = key_states.shape
        if b != self.store.batch_size:
            raise CacheMisuseError(
                f"batch size changed from {self.store.batch_size} to {b}; a compressed cache serves one batch "
                "(beam search and num_return_sequences > 1 are not supported)"
            )
        modality, valid = self.cache.token_info(self.layer_idx, b, q, key_states.device)
        positions = torch.arange(self.seen, self.seen + q, device=key_states.device)
        self.store.append(key_states, value_states, positions, modality, valid)
        if self.cache.gates is not None:
            self.store.set_tail_state("log_beta", self.cache.take_log_beta(self.layer_idx, b, q))
        self.seen += q
        hand_over(self)
        return key_states, value_states

    def attend(self, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """Attention of the new queries over what this layer holds; [B, Q, Hq, D]."""
        store = self.store
        q = query.shape[2]
        self.scaling = scaling
        view = store.padded_view(with_values=True, with_modality=False)
        query_positions = store.tail_positions[-q:].long()
        dense = store.body_size == 0 and bool(store.tail_valid.all())
        out = self.cache.attend_fn(query, view, query_positions, scaling, dense)
        self.cache.scorer.observe(store, query, view, query_positions, scaling)
        self._remember_queries(query, query_positions)
        if self.layer_idx == self.cache.num_layers - 1:
            self.cache.end_of_forward(q)
        return out

    def _remember_queries(self, query: torch.Tensor, positions: torch.Tensor) -> None:
        w = self.cache.scorer.query_window
        if w <= 0:
            return
        if self.window_queries is None:
            self.window_queries, self.window_positions = query[:, :, -w:], positions[-w:]
        else:
            self.window_queries = torch.cat([self.window_queries, query], dim=2)[:, :, -w:]
            self.window_positions = torch.cat([self.window_positions, positions])[-w:]

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.store = None
        self.seen = 0
        self.window_queries = self.window_positions = None
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        raise CacheMisuseError("a compressed cache cannot be cropped: evicted entries are gone")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise CacheMisuseError("beam search is not supported by the compressed cache")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise CacheMisuseError("num_return_sequences > 1 / beam search is not supported by the compressed cache")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise CacheMisuseError("batch selection is not supported by the compressed cache")


class CompressedCache(Cache):
    """A KV cache that keeps ``budget`` of the full cache, chosen by ``scorer`` and spread by ``allocation``.

    Build it with ``vlm_kv.make_cache(model, policy=..., budget=...)``; pass it to
    ``model.generate(past_key_values=cache)`` or ``model(past_key_values=cache)``.
    """

    def __init__(
        self,
        adapter: ModelAdapter,
        scorer: Scorer,
        allocation: Allocation,
        budget: Budget,
        evict_every: int = 16,
        slack: int = 0,
        policy_name: str = "",
        model_id: int | None = None,
        seed: int = 0,
        gates: torch.nn.Module | None = None,
    ) -> None:
        if evict_every < 1:
            raise ValueError(f"evict_every must be >= 1, got {evict_every}")
        if slack < 0:
            raise ValueError(f"slack must be >= 0, got {slack}")
        self.adapter = adapter
        self.scorer = scorer
        self.allocation = allocation
        self.budget = budget
        self.evict_every = evict_every
        self.slack = slack
        self.policy_name = policy_name
        self.model_id = model_id
        self.num_layers = adapter.num_layers
        self.attend_fn = varlen_attention
        self.generator = torch.Generator().manual_seed(seed)
        self._pending_modality: torch.Tensor | None = None
        self._pending_valid: torch.Tensor | None = None
        self._forward_info: tuple[torch.Tensor, torch.Tensor] | None = None
        self.valid_tokens: torch.Tensor | None = None   # [B] real tokens seen per sequence
        self.first_positions: torch.Tensor | None = None  # [B] position of each sequence's first real token
        self.decode_steps_since_eviction = 0
        self.eviction_steps = 0
        self.max_kv_bytes = 0
        self.evicted_entries = 0
        self.gates = gates
        self._log_beta: dict[int, torch.Tensor] = {}
        if "log_beta" in scorer.state_names and gates is None:
            raise ValueError(f"policy {policy_name!r} scores with retention gates: pass gates=")
        super().__init__(layers=[CompressedLayer(self, i) for i in range(self.num_layers)])

    # ------------------------------------------------------------ inputs
    def set_forward_inputs(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, q_len: int) -> None:
        """Called before each forward (by the model hook) with what only the model inputs know."""
        self._pending_modality = self.adapter.modality_of(input_ids) if input_ids is not None else None
        if attention_mask is not None and attention_mask.dim() == 2:
            self._pending_valid = attention_mask[:, -q_len:].bool()
        else:
            self._pending_valid = None

    def token_info(self, layer_idx: int, batch: int, q: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Modality and validity of the tokens entering this forward ([B, Q] each)."""
        if layer_idx == 0 or self._forward_info is None:
            modality, valid = self._pending_modality, self._pending_valid
            if modality is None or modality.shape != (batch, q):
                modality = torch.zeros(batch, q, dtype=torch.uint8, device=device)
            if valid is None or valid.shape != (batch, q):
                valid = torch.ones(batch, q, dtype=torch.bool, device=device)
            modality, valid = modality.to(device), valid.to(device)
            self._forward_info = (modality, valid)
            self._pending_modality = self._pending_valid = None
            self._count_tokens(valid, self.layers[0].seen)
        return self._forward_info

    def _count_tokens(self, valid: torch.Tensor, start: int) -> None:
        counts = valid.sum(dim=1).long()
        idx = torch.arange(valid.shape[1], device=valid.device) + start
        first = torch.where(valid, idx, torch.full_like(idx, 2**62)).min(dim=1).values
        if self.valid_tokens is None:
            self.valid_tokens, self.first_positions = counts, first
        else:
            self.valid_tokens = self.valid_tokens + counts
            self.first_positions = torch.minimum(self.first_positions, first)

    def stash_log_beta(self, layer_idx: int, log_beta: torch.Tensor) -> None:
        """Gate output for the tokens about to enter ``layer_idx`` ([B, H, Q])."""
        self._log_beta[layer_idx] = log_beta

    def take_log_beta(self, layer_idx: int, batch: int, q: int) -> torch.Tensor:
        log_beta = self._log_beta.pop(layer_idx, None)
        if log_beta is None or log_beta.shape[0] != batch or log_beta.shape[-1] != q:
            raise RuntimeError(
                f"no gate output for layer {layer_idx}: the gate hook did not run (was the cache built "
                "with vlm_kv.make_cache for this model?)"
            )
        return log_beta

    # ---------------------------------------------------------- eviction
    def end_of_forward(self, q_len: int) -> None:
        self._forward_info = None
        if q_len > 1:
            self.evict()
            return
        self.decode_steps_since_eviction += 1
        if self.decode_steps_since_eviction >= self.evict_every:
            self.evict()

    def capacities(self) -> torch.Tensor:
        """[B] tokens per head each sequence keeps after an eviction step (budget minus slack)."""
        caps = [max(0, self.budget.capacity(int(n)) - self.slack) for n in self.valid_tokens.tolist()]
        caps = torch.tensor(caps, dtype=torch.long, device=self.valid_tokens.device)
        sinks = self.scorer.sinks
        for b, (cap, n) in enumerate(zip(caps.tolist(), self.valid_tokens.tolist())):
            needed = min(sinks, n) + min(self.scorer.protected_window(cap), n)
            if cap < needed and cap < n:
                raise BudgetError(
                    f"budget too small: {self.budget.describe()} gives {cap} tokens per KV head for a "
                    f"sequence of {n} tokens (batch row {b}), but policy {self.policy_name or self.scorer.name!r} "
                    f"always keeps {needed} ({sinks} sinks + {self.scorer.protected_window(cap)} recent); "
                    "raise the budget or shrink the policy's window"
                )
        return caps

    def _scores(self, layer: CompressedLayer, view, caps: torch.Tensor, cap_layer: torch.Tensor) -> torch.Tensor:
        ctx = ScoreContext(
            layer_idx=layer.layer_idx,
            num_layers=self.num_layers,
            view=view,
            window_queries=layer.window_queries,
            window_positions=layer.window_positions,
            scaling=layer.scaling,
            seen=layer.seen,
            capacity=cap_layer,
            generator=self.generator,
        )
        scores = self.scorer.score(ctx)
        windows = torch.tensor([self.scorer.protected_window(int(c)) for c in cap_layer.tolist()],
                               dtype=torch.long, device=view.positions.device)
        return protect(scores, view, self.scorer.sinks, windows, self.first_positions, layer.seen)

    @torch.no_grad()
    def evict(self) -> None:
        """One eviction step over every layer; afterwards the cache holds at most its budget."""
        self.decode_steps_since_eviction = 0
        caps = self.capacities()
        states = self.scorer.state_names
        before = self.num_entries()
        window = self.scorer.protected_window(int(caps.max())) if caps.numel() else 0
        if self.allocation.is_global:
            scores, modality = [], []
            for layer in self.layers:
                view = layer.store.padded_view(with_values=False, states=states)
                scores.append(self._scores(layer, view, caps, caps))
                modality.append(view.modality)
            keeps = self.allocation.keep_all(scores, caps, modality)
            for layer, keep in zip(self.layers, keeps):
                layer.store.compact(keep)
        else:
            for layer in self.layers:
                cap_layer = self.allocation.layer_capacity(layer.layer_idx, self.num_layers, caps, window)
                view = layer.store.padded_view(with_values=True, states=states)
                keep = self.allocation.keep_layer(self._scores(layer, view, caps, cap_layer), cap_layer)
                layer.store.compact(keep, view)
        self.eviction_steps += 1
        self.evicted_entries += before - self.num_entries()
        self.max_kv_bytes = max(self.max_kv_bytes, self.kv_bytes()["total"])

    # ------------------------------------------------------------ report
    def num_entries(self) -> int:
        return sum(layer.store.num_entries() for layer in self.layers if layer.store is not None)

    def budget_bytes(self) -> int:
        """Bytes the budget allows for the tokens seen so far (what ``kv_bytes`` stays under after eviction)."""
        stores = [layer.store for layer in self.layers if layer.store is not None]
        if not stores or self.valid_tokens is None:
            return 0
        per_entry = stores[0].bytes_per_entry
        heads = sum(s.num_kv_heads for s in stores)
        caps = [self.budget.capacity(int(n)) for n in self.valid_tokens.tolist()]
        return sum(caps) * heads * per_entry

    def full_kv_bytes(self) -> int:
        """Bytes an uncompressed DynamicCache would hold for the same tokens."""
        total = 0
        for layer in self.layers:
            if layer.store is not None:
                s = layer.store
                total += s.batch_size * s.num_kv_heads * layer.seen * s.bytes_per_entry
        return total

    def _modality_totals(self, weight_by_bytes: bool) -> dict[str, int]:
        totals = torch.zeros(len(MODALITIES), dtype=torch.long)
        for layer in self.layers:
            if layer.store is not None:
                counts = layer.store.modality_counts().cpu()
                totals += counts * (layer.store.bytes_per_entry if weight_by_bytes else 1)
        return {name: int(v) for name, v in zip(MODALITIES, totals.tolist())}

    def kv_bytes(self) -> dict[str, Any]:
        """Bytes actually allocated: total, per layer, per modality, per tier; metadata apart."""
        per_layer = [layer.store.kv_bytes() if layer.store is not None else 0 for layer in self.layers]
        total = sum(per_layer)
        return {
            "total": total,
            "per_layer": per_layer,
            "per_modality": self._modality_totals(weight_by_bytes=True),
            "per_tier": {"fp": total, "int2": 0},
            "metadata": sum(layer.store.meta_bytes() for layer in self.layers if layer.store is not None),
        }

    def stats(self) -> dict[str, Any]:
        """Entry counts: total, per layer, per modality, per-head length spread, eviction steps."""
        per_layer = [layer.store.num_entries() if layer.store is not None else 0 for layer in self.layers]
        lengths = [layer.store.head_lengths().flatten().cpu() for layer in self.layers if layer.store is not None]
        heads = torch.cat(lengths).float() if lengths else torch.zeros(1)
        return {
            "policy": self.policy_name,
            "budget": self.budget.describe(),
            "seen_tokens": self.get_seq_length(),
            "entries": sum(per_layer),
            "per_layer": per_layer,
            "per_modality": self._modality_totals(weight_by_bytes=False),
            "head_length": {"min": int(heads.min()), "mean": float(heads.mean()), "max": int(heads.max())},
            "eviction_steps": self.eviction_steps,
            "evicted_entries": self.evicted_entries,
        }
