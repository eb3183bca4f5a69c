"""The compressed cache: a transformers ``Cache`` whose layers evict under a budget.

Lifecycle, as in transformers' cache_utils:

* the model's forward pre-hook (``vlm_kv.api``) calls ``begin_forward`` with what only the
  inputs know (modality, padding), recorded by the ``TokenLedger``;
* each ``CompressedLayer`` lazily creates its store on the first ``update``; ``update`` appends
  the new tokens in place and hands the layer to the registered attention function, which
  attends over the store (``attend``);
* the forward post-hook calls ``end_forward``: it checks every hand-off was consumed and, after
  a prefill or every ``evict_every`` decode steps, runs the ``Evictor`` over all layers.

Positions are never rewritten: ``get_seq_length`` counts every token seen, so the model's
RoPE / M-RoPE positions and ``cache_position`` stay those of the uncompressed run, while each
stored entry remembers its own original position.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from vlm_kv.attention import backend, decode, handoff, reference
from vlm_kv.cache import report
from vlm_kv.config import Budget, CacheOptions, TierConfig
from vlm_kv.eviction.evictor import Evictor
from vlm_kv.kernels.dispatch import resolve_backend
from vlm_kv.kernels.varlen_prefill import flash_attn_available
from vlm_kv.models.adapters import ModelAdapter
from vlm_kv.policies.base import Scorer
from vlm_kv.storage.allocation import Allocation
from vlm_kv.storage.ledger import CacheMisuseError, TokenLedger
from vlm_kv.storage.store import VarlenKVStore, tensor_bytes
from vlm_kv.tiers.int2_tier import Int2Tier
from vlm_kv.tiers.window_router import TierRouter, merge_views

__all__ = ["CacheMisuseError", "CompressedCache", "CompressedLayer"]


class CompressedLayer(CacheLayerMixin):
    """One decoder layer's compressed KV cache: its store, its recent queries, its attention."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, cache: "CompressedCache", layer_idx: int) -> None:
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.store: VarlenKVStore | None = None
        self.tier: Int2Tier | None = None  # the INT2 tier and its ledger (tiered caches only)
        self.seen = 0
        self.scaling: float | None = None
        # ring buffer of the most recent queries (observation-window scorers)
        self._queries: torch.Tensor | None = None
        self._query_positions: torch.Tensor | None = None
        self._queries_filled = 0
        self._queries_next = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.device = key_states.device
        self.store = VarlenKVStore(b, h, d, key_states.dtype, key_states.device, self.cache.scorer.state_names,
                                   tail_reserve=self.cache.evictor.evict_every)
        if self.cache.tiers is not None:
            self.tier = Int2Tier.for_keys(key_states, self.cache.tiers, self.cache.scorer.state_names,
                                          rope=self.cache.key_rotation)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, _, q, _ = key_states.shape
        if b != self.store.batch_size:
            raise CacheMisuseError(
                f"batch size changed from {self.store.batch_size} to {b}; a compressed cache serves one batch "
                "(beam search is not supported)"
            )
        record = self.cache.ledger.enter(b, q, key_states.device)
        self.store.append(key_states, value_states, self.seen, record.modality, record.valid, record.all_valid)
        if self.cache.gates is not None and not self.cache.take_deferred_gate(self.layer_idx, b, q):
            self.cache.store_log_beta(self.layer_idx, self.cache.take_log_beta(self.layer_idx, b, q))
        self.seen += q
        handoff.hand_over(self)
        return key_states, value_states

    def attend(self, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """Attention of the new queries over what this layer holds; [B, Q, Hq, D]."""
        store = self.store
        q = query.shape[2]
        self.scaling = scaling
        query_positions = store.tail_positions[-q:].long()
        scorer = self.cache.scorer.for_layer(self.layer_idx)
        if self.tier is not None and self.tier.num_active:
            out = self._attend_tiered(query, query_positions, scaling, scorer)
        elif q == 1 and self.cache.use_triton_decode(query) and store.tail_all_valid and not scorer.uses_received_attention:
            out = backend.decode_attention_triton(query, store, scaling)
            if scorer.observes:
                view = store.padded_view(with_values=False, with_modality=False)
                scorer.observe(store, query, view, query_positions, scaling)
        elif q == 1:
            out, received = decode.decode_attention(query, store, scaling, scorer.uses_received_attention)
            if received is not None:
                scorer.observe_received(store, *received)
            elif scorer.observes:
                view = store.padded_view(with_values=False, with_modality=False)
                scorer.observe(store, query, view, query_positions, scaling)
        elif store.body_size and store.tail_all_valid and self.cache.use_flash_prefill(query):
            out = backend.prefill_attention_paged(query, store, scaling, backend="flash")
            if scorer.observes:
                view = store.padded_view(with_values=False, with_modality=False)
                scorer.observe(store, query, view, query_positions, scaling)
        else:
            view = store.padded_view(with_values=True, with_modality=False)
            dense = store.body_size == 0 and store.tail_all_valid
            out = reference.varlen_attention(query, view, query_positions, scaling, dense)
            scorer.observe(store, query, view, query_positions, scaling)
        self._remember_queries(query, query_positions)
        if q > 1:
            self.cache.after_prefill_attention(self)
        return out

    def _attend_tiered(self, query: torch.Tensor, query_positions: torch.Tensor, scaling: float | None,
                       scorer: Scorer) -> torch.Tensor:
        """One softmax over the FP entries and the dequantized INT2 windows; scorers observe both."""
        if (query.shape[2] == 1 and self.cache.use_triton_decode(query) and self.store.tail_all_valid
                and self.tier.kernel_readable and not scorer.observes):
            return backend.tiered_decode_attention_triton(query, self.store, self.tier, scaling)
        if query.shape[2] == 1 and self.tier.rotated and self.tier.rope is None and not scorer.observes:
            # rotate the query and the INT2 output, not every INT2 entry (as the kernel does)
            fp = self.store.padded_view(with_values=True)
            tv = self.tier.view(with_values=True, dtype=torch.float32, in_basis=True)
            return reference.rotated_tier_attention(query, fp, tv.view, self.tier.key_basis, self.tier.value_basis,
                                                    query_positions, scaling)
        fp = self.store.padded_view(with_values=True)
        tv = self.tier.view(with_values=True, dtype=query.dtype)
        view, _ = merge_views(fp, tv.view, sort=False)
        out = reference.varlen_attention(query, view, query_positions, scaling)
        if scorer.observes:
            scorer.observe(_TieredEntries(self.store, self.tier, fp.length, tv.slot), query, view, query_positions, scaling)
        return out

    def num_entries(self) -> int:
        """Entries held in every tier."""
        if self.store is None:
            return 0
        return self.store.num_entries() + (self.tier.num_entries() if self.tier is not None else 0)

    def _remember_queries(self, query: torch.Tensor, positions: torch.Tensor) -> None:
        w = self.cache.scorer.for_layer(self.layer_idx).query_window
        if w <= 0:
            return
        n = min(query.shape[2], w)
        self._grow_query_ring(query, min(w, self._queries_filled + n))
        if n == 1:  # a decode step: one slot, no index tensors
            slot = self._queries_next
            self._queries[:, :, slot] = query[:, :, -1]
            self._query_positions[slot] = positions[-1]
        else:
            slots = (self._queries_next + torch.arange(n, device=query.device)) % w
            self._queries.index_copy_(2, slots, query[:, :, -n:])
            self._query_positions.index_copy_(0, slots, positions[-n:])
        self._queries_next = (self._queries_next + n) % w
        self._queries_filled = min(w, self._queries_filled + n)

    def _grow_query_ring(self, query: torch.Tensor, size: int) -> None:
        """Room for ``size`` queries: the ring grows with the queries seen, up to the window, so a
        short prompt does not hold a whole window of empty slots. Until it is full it fills in
        order (the next slot is the count held), so growing keeps every query where it is."""
        if self._queries is not None and self._queries.shape[2] >= size:
            return
        b, hq, _, d = query.shape
        queries = torch.zeros(b, hq, size, d, dtype=query.dtype, device=query.device)
        positions = torch.zeros(size, dtype=torch.long, device=query.device)
        if self._queries is not None:
            held = self._queries_filled
            queries[:, :, :held] = self._queries[:, :, :held]
            positions[:held] = self._query_positions[:held]
        self._queries, self._query_positions = queries, positions

    @property
    def window_queries(self) -> torch.Tensor | None:
        """[B, Hq, w, D] the most recent queries (in ring order; scorers sum over them)."""
        return None if self._queries is None else self._queries[:, :, : self._queries_filled]

    @property
    def window_positions(self) -> torch.Tensor | None:
        return None if self._queries is None else self._query_positions[: self._queries_filled]

    def held_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Original positions of every entry this layer holds, per (batch, kv head), and their tier.

        Returns ``(positions [B, H, L] long, -1 where a row is shorter; tier [B, H, L] uint8,
        0 = full precision, 1 = INT2)``. Diagnostics compare these sets between eviction steps.
        """
        if self.store is None:
            raise CacheMisuseError(f"layer {self.layer_idx} holds nothing yet (no forward ran)")
        view = self.store.padded_view(with_values=False, with_modality=False)
        positions = view.positions.masked_fill(~view.valid, -1)
        tier = torch.zeros_like(positions, dtype=torch.uint8)
        if self.tier is not None and self.tier.num_active:
            tv = self.tier.view(with_values=False).view
            positions = torch.cat([positions, tv.positions.masked_fill(~tv.valid, -1)], dim=2)
            tier = torch.cat([tier, torch.ones_like(tv.positions, dtype=torch.uint8)], dim=2)
        return positions, tier

    def query_window_bytes(self) -> int:
        return tensor_bytes(self._queries, self._query_positions)

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.store = None
        self.tier = None
        self.seen = 0
        self._queries = self._query_positions = None
        self._queries_filled = self._queries_next = 0
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        raise CacheMisuseError("a compressed cache cannot be cropped: evicted entries are gone")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise CacheMisuseError("beam search is not supported by the compressed cache")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats == 1 or self.store is None:
            return
        self.store.repeat_batch(repeats)
        if self.tier is not None:
            self.tier.repeat_batch(repeats)
        if self._queries is not None:
            self._queries = self._queries.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise CacheMisuseError("batch selection is not supported by the compressed cache")


class _TieredEntries:
    """Where a scorer's observation lands when its view spans the FP store and the INT2 tier:
    the first ``fp_length`` columns belong to the store, the rest to the tier's windows."""

    def __init__(self, store: VarlenKVStore, tier: Int2Tier, fp_length: int, slot: torch.Tensor) -> None:
        self.store, self.tier, self.fp_length, self.slot = store, tier, fp_length, slot

    def add_state(self, name: str, padded: torch.Tensor) -> None:
        self.store.add_state(name, padded[..., : self.fp_length])
        self.tier.add_state(name, padded[..., self.fp_length :], self.slot)


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
        *,
        options: CacheOptions = CacheOptions(),
        tiers: TierConfig | None = None,
        gates: torch.nn.Module | None = None,
        key_rotation=None,
        policy_name: str = "",
        model_id: int | None = None,
    ) -> None:
        evict_every = options.eviction_interval(tiers)
        if "log_beta" in scorer.state_names and gates is None:
            raise ValueError(f"policy {policy_name!r} scores with retention gates: pass gates=")
        self.adapter = adapter
        self.ledger = TokenLedger(adapter)
        self.evictor = Evictor(scorer, allocation, budget, evict_every, options.slack, options.seed)
        self.tiers = tiers
        self.key_rotation = key_rotation  # KeyRotation for pre-RoPE INT2 keys (tiers.key_rope == "pre")
        self.router = TierRouter(tiers) if tiers is not None else None
        self.policy_name = policy_name
        self.model_id = model_id
        self.prefill_chunk = options.prefill_chunk
        self.attention_backend = options.attention_backend
        self._triton_decode: bool | None = None
        self.num_layers = adapter.num_layers
        self.gates = gates
        self.gate_stash: dict[int, torch.Tensor] = {}  # log beta of the tokens about to enter a layer
        # decode steps defer the gates to the end of the forward, where one batched call serves
        # every layer: the hidden state each layer's gate will read ([L, B, d], one row per layer),
        # which layers have it, and which of those already stored their token
        self.gate_inputs: torch.Tensor | None = None
        self.gate_inputs_waiting: set[int] = set()
        self.gate_inputs_stored: set[int] = set()
        self.max_kv_bytes = 0      # most key/value bytes held right after an eviction step
        self.peak_kv_bytes = 0     # most held at any forward's end (just before its eviction step)
        self.evict_seconds = 0.0   # wall time spent in eviction steps
        self.chunked_prefills = 0
        self._layerwise = None       # the prefill's layer-by-layer eviction step in flight
        self._fresh_forward = False  # the user's call this forward belongs to started on an empty cache
        self._evicts_at_end = True   # this forward leaves all eviction to its end (not layer by layer)
        self.call_started_empty: bool | None = None  # set by the model pre-hook for every user call
        self.in_chunk_loop = False   # the pre-hook is feeding a long prompt's chunks
        # called with the cache after every eviction step (diagnostics, recorders)
        self.eviction_listeners: list[Callable[["CompressedCache"], None]] = []
        super().__init__(layers=[CompressedLayer(self, i) for i in range(self.num_layers)])

    # the evictor's parts, read by layers, reports and tools
    @property
    def scorer(self) -> Scorer:
        return self.evictor.scorer

    @property
    def allocation(self) -> Allocation:
        return self.evictor.allocation

    @property
    def budget(self) -> Budget:
        return self.evictor.budget

    @property
    def evict_every(self) -> int:
        return self.evictor.evict_every

    @property
    def eviction_steps(self) -> int:
        return self.evictor.eviction_steps

    @property
    def evicted_entries(self) -> int:
        return self.evictor.evicted_entries

    def use_triton_decode(self, query: torch.Tensor) -> bool:
        """Whether decode steps run the Triton paged kernel (resolved once: CUDA + triton for "auto")."""
        if self._triton_decode is None:
            if self.attention_backend == "torch":
                self._triton_decode = False
            else:
                self._triton_decode = resolve_backend(self.attention_backend, query.device) == "triton"
        return self._triton_decode

    def use_flash_prefill(self, query: torch.Tensor) -> bool:
        """Whether a prefill over a compressed store runs flash-attn's varlen function (CUDA, fp16/bf16)."""
        if self.attention_backend == "torch" or query.device.type != "cuda" or query.dtype not in (torch.float16, torch.bfloat16):
            return False

        return flash_attn_available()

    # ------------------------------------------------------------ forward
    def begin_forward(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, q_len: int | None) -> None:
        """Before each forward (the model pre-hook): what only the model inputs know."""
        self._clear_gate_hand_offs()
        self.ledger.announce(input_ids, attention_mask, q_len)
        self._layerwise = None
        self._fresh_forward = self.call_started_empty if self.call_started_empty is not None else self.is_empty()
        self._evicts_at_end = not self._fresh_forward or self.router is not None
        handoff.begin_forward()

    def is_empty(self) -> bool:
        """No layer has seen a token yet."""
        return all(layer.seen == 0 for layer in self.layers)

    def after_prefill_attention(self, layer: CompressedLayer) -> None:
        """A layer attended over several new tokens: evict from it now rather than at the end of
        the forward, so the prompt's keys and values never fill every layer.

        Only a call that started on an empty cache does this (a prompt, or each chunk of a prompt
        fed in chunks): if it fails half-way, undoing it means emptying the cache, and nothing
        held before the call is lost. A new turn on a non-empty cache, and a tiered cache, evict
        at the end of the forward."""
        if self._evicts_at_end:
            return
        start = time.perf_counter()
        if self._layerwise is None:
            self._layerwise = self.evictor.begin_layerwise(self.ledger, self.num_layers)
            if self._layerwise is None:  # not splittable by layer: the end-of-forward step does it all
                self._evicts_at_end = True
                return
        self.peak_kv_bytes = max(self.peak_kv_bytes, report.total_kv_bytes(self))
        self.evictor.evict_layer(self._layerwise, layer, self.ledger)
        self.evict_seconds += time.perf_counter() - start

    def end_forward(self) -> None:
        """After each forward (the model post-hook): check hand-offs, then evict if it is time."""
        handoff.end_forward()
        left = sorted(set(self.gate_stash) | self.gate_inputs_waiting)
        if left:
            self._clear_gate_hand_offs()
            raise CacheMisuseError(f"gate outputs for layers {left} were computed but never stored in the cache")
        self._store_deferred_log_betas()
        q = self.ledger.end_forward()
        if q and self.evictor.due(q, prompt=self._fresh_forward):
            self.peak_kv_bytes = max(self.peak_kv_bytes, report.total_kv_bytes(self))
            self.evict()

    def abort_forward(self) -> None:
        """The forward raised: drop its hand-offs and the tokens some layers already stored, so the
        cache is as it was before the call (nothing of what it held is lost)."""
        handoff.end_forward_quietly()
        self._clear_gate_hand_offs()
        self.ledger.abort_forward()
        self._layerwise = None
        if self._fresh_forward:  # the call started empty (and may have evicted layer by layer): empty it again
            for layer in self.layers:
                layer.reset()
            self.ledger.reset()  # earlier chunks of the call counted their tokens there
            return
        for layer in self.layers:
            extra = layer.seen - self.ledger.seen
            if layer.store is not None and extra > 0:
                layer.store.drop_newest(extra)
                layer.seen -= extra

    def stash_log_beta(self, layer_idx: int, log_beta: torch.Tensor) -> None:
        """Gate output for the tokens about to enter ``layer_idx`` ([B, H, Q])."""
        self.gate_stash[layer_idx] = log_beta

    def defer_gate(self, layer_idx: int, hidden: torch.Tensor) -> None:
        """Keep the hidden state of a one-token step entering ``layer_idx`` ([B, 1, d]); its
        gate runs with every other layer's at the end of the forward."""
        b, _, d = hidden.shape
        if self.gate_inputs is None or self.gate_inputs.shape[1:] != (b, d) or self.gate_inputs.dtype != hidden.dtype:
            self.gate_inputs = hidden.new_empty(self.num_layers, b, d)
        self.gate_inputs[layer_idx].copy_(hidden[:, 0])
        self.gate_inputs_waiting.add(layer_idx)

    def take_deferred_gate(self, layer_idx: int, batch: int, q: int) -> bool:
        """Whether the gate of the token ``layer_idx`` just stored was deferred: its log beta is
        then written at the end of the forward."""
        if layer_idx not in self.gate_inputs_waiting:
            return False
        if q != 1 or self.gate_inputs.shape[1] != batch:
            raise CacheMisuseError(f"layer {layer_idx} stored {batch}x{q} tokens but its gate saw {self.gate_inputs.shape[1]}x1")
        self.gate_inputs_waiting.discard(layer_idx)
        self.gate_inputs_stored.add(layer_idx)
        return True

    def _store_deferred_log_betas(self) -> None:
        if not self.gate_inputs_stored:
            return
        with torch.no_grad():
            log_beta = self.gates.log_beta_stacked(self.gate_inputs)  # [L, B, H]
        for idx in sorted(self.gate_inputs_stored):
            self.store_log_beta(idx, log_beta[idx].unsqueeze(-1))
        self.gate_inputs_stored.clear()
        self.gate_inputs = None  # one forward's hand-off: not kept between forwards

    def _clear_gate_hand_offs(self) -> None:
        self.gate_stash.clear()
        self.gate_inputs_waiting.clear()
        self.gate_inputs_stored.clear()

    def store_log_beta(self, layer_idx: int, log_beta: torch.Tensor) -> None:
        """Write the gate output of the newest ``log_beta.shape[-1]`` tokens of ``layer_idx``
        ([B, H, Q]): the one way log betas reach the stores, from a prefill or a decode step."""
        self.layers[layer_idx].store.set_tail_state("log_beta", log_beta)

    def take_log_beta(self, layer_idx: int, batch: int, q: int) -> torch.Tensor:
        log_beta = self.gate_stash.pop(layer_idx, None)
        if log_beta is None or log_beta.shape[0] != batch or log_beta.shape[-1] != q:
            raise CacheMisuseError(
                f"no gate output for layer {layer_idx}: the gate hook did not run (was the cache built "
                "with vlm_kv.make_cache for this model?)"
            )
        return log_beta

    @torch.no_grad()
    def evict(self) -> None:
        """One eviction step over every layer; afterwards the cache holds at most its budget."""
        layers = [layer for layer in self.layers if layer.store is not None]
        if not layers or self.ledger.valid_tokens is None:
            return
        start = time.perf_counter()
        step, self._layerwise = self._layerwise, None
        if self.router is not None:
            self.router.route(self.evictor, layers, self.ledger)
        elif step is not None:
            self.evictor.finish_layerwise(step, layers, self.ledger)
        else:
            self.evictor.evict(layers, self.ledger)
        self.evict_seconds += time.perf_counter() - start
        self._bound_spare_room()
        held = report.total_kv_bytes(self)
        self.max_kv_bytes = max(self.max_kv_bytes, held)
        self.peak_kv_bytes = max(self.peak_kv_bytes, held)
        for listener in self.eviction_listeners:
            listener(self)

    def _bound_spare_room(self) -> None:
        """After an eviction step: how many spare tokens per head the decode tail may reserve before
        the next one. At most the budget's tokens per head (so spare room never dwarfs a small
        budget), and at most what the room this layer freed pays for, so the cache never holds more
        than a DynamicCache would for the same tokens (a budget of 1.0 frees nothing: no spare room)."""
        caps = self.evictor.capacities(self.ledger.valid_tokens)
        by_budget = int(caps.min()) if caps.numel() else 0
        for layer in self.layers:
            if layer.store is None:
                continue
            room = report.full_layer_bytes(layer) - report.layer_held_bytes(layer)
            layer.store.spare_limit = max(0, min(by_budget, room // layer.store.slot_bytes()))

    def reset(self) -> None:
        """Empty the cache for a new conversation: every layer and what the ledger counted."""
        super().reset()
        self.ledger.reset()
        self._clear_gate_hand_offs()
        self._layerwise = None
        self.evictor.decode_steps_since_eviction = 0

    # ------------------------------------------------------------ batch
    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self.ledger.repeat_batch(repeats)
        self.evictor.repeat_batch(repeats)

    # ------------------------------------------------------------ report
    @property
    def valid_tokens(self) -> torch.Tensor | None:
        return self.ledger.valid_tokens

    def num_entries(self) -> int:
        return sum(layer.num_entries() for layer in self.layers)

    def budget_bytes(self) -> int:
        return report.budget_bytes(self)

    def full_kv_bytes(self) -> int:
        return report.full_kv_bytes(self)

    def kv_bytes(self) -> dict[str, Any]:
        return report.kv_bytes(self)

    def stats(self) -> dict[str, Any]:
        return report.stats(self)
