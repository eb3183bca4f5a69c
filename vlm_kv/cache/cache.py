"""The compressed cache: a transformers ``Cache`` whose layers evict under a budget.

Lifecycle, as in transformers' cache_utils:

* the model's forward pre-hook (``vlm_kv.cache.hooks``) calls ``begin_forward`` with what only
  the inputs know (modality, padding), recorded by the ``TokenLedger``;
* the attention module calls ``update``: the layer (``CompressedLayer``, or ``TieredLayer`` for
  a tiered cache) lazily creates its store and appends the new tokens in place; the cache writes
  the gates' output beside them (``GateHandOff``) and leaves the registered attention function a
  note, which calls back ``attend``: the layer attends over its store, and a prefill on an empty
  cache is evicted from that layer at once;
* the forward post-hook calls ``end_forward``: it checks every hand-off was consumed and, after
  a prefill or every ``evict_every`` decode steps, runs the ``Evictor`` (or the tier router) over
  all layers.

The layers own their state and know nothing of the cache; the cache orchestrates them.
Positions are never rewritten: ``get_seq_length`` counts every token seen, so the model's
RoPE / M-RoPE positions and ``cache_position`` stay those of the uncompressed run, while each
stored entry remembers its own original position.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
from transformers.cache_utils import Cache

from vlm_kv.attention import handoff
from vlm_kv.cache import report
from vlm_kv.attention.backend import AttentionPaths
from vlm_kv.cache.gate_handoff import GateHandOff
from vlm_kv.cache.layer import CompressedLayer, LayerSpec
from vlm_kv.cache.tiered_layer import TieredLayer
from vlm_kv.config import Budget, CacheOptions, TierConfig
from vlm_kv.eviction.evictor import Evictor
from vlm_kv.models.adapters import ModelAdapter
from vlm_kv.policies.base import Scorer
from vlm_kv.storage.allocation import Allocation
from vlm_kv.storage.host_heap import return_freed_heap
from vlm_kv.storage.ledger import CacheMisuseError, TokenLedger
from vlm_kv.tiers.rope_keys import KeyRotation
from vlm_kv.tiers.window_router import TierRouter

__all__ = ["CacheMisuseError", "CompressedCache", "CompressedLayer", "TieredLayer"]

# keys and values freed by layer-by-layer eviction on CPU before the heap is given back to the OS
HEAP_TRIM_BYTES = 16 * 2**20


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
        key_rotation: KeyRotation | None = None,
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
        self.router = TierRouter(tiers) if tiers is not None else None
        self.policy_name = policy_name
        self.model_id = model_id
        self.prefill_chunk = options.prefill_chunk
        self.layerwise_prefill = options.layerwise_prefill
        self.paths = AttentionPaths(options.attention_backend)
        self.num_layers = adapter.num_layers
        self.gate_handoff = GateHandOff(gates, self.num_layers)
        self.max_kv_bytes = 0      # most key/value bytes held right after an eviction step
        self.peak_kv_bytes = 0     # most held at any forward's end (just before its eviction step)
        self.evict_seconds = 0.0   # wall time spent in eviction steps
        self.chunked_prefills = 0
        self._layerwise = None       # the prefill's layer-by-layer eviction step in flight
        self._freed_since_trim = 0   # bytes of keys / values freed on CPU since the heap was last trimmed
        self._fresh_forward = False  # the user's call this forward belongs to started on an empty cache
        self._evicts_at_end = True   # this forward leaves all eviction to its end (not layer by layer)
        self.call_started_empty: bool | None = None  # set by the model pre-hook for every user call
        self.in_chunk_loop = False   # the pre-hook is feeding a long prompt's chunks
        # called with the cache after every eviction step (diagnostics, recorders)
        self.eviction_listeners: list[Callable[["CompressedCache"], None]] = []
        # what every layer needs from the policy, given once (a layer never reads the cache)
        spec = LayerSpec(tuple(scorer.state_names), tail_reserve=evict_every, tiers=tiers, key_rotation=key_rotation)
        layer_class = TieredLayer if tiers is not None else CompressedLayer
        super().__init__(layers=[layer_class(spec, i) for i in range(self.num_layers)])

    # the evictor's parts, read by reports and tools
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

    @property
    def gates(self) -> torch.nn.Module | None:
        """The retention gates of a gated cache (their outputs reach the stores through ``gate_handoff``)."""
        return self.gate_handoff.gates

    # ------------------------------------------------------------ forward
    def begin_forward(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, q_len: int | None) -> None:
        """Before each forward (the model pre-hook): what only the model inputs know."""
        self.gate_handoff.clear()
        self.ledger.announce(input_ids, attention_mask, q_len)
        self._layerwise = None
        self._fresh_forward = self.call_started_empty if self.call_started_empty is not None else self.is_empty()
        self._evicts_at_end = not self._fresh_forward or not self.layerwise_prefill
        handoff.begin_forward()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention module of layer ``layer_idx`` stores its new keys and values ([B, H, Q, D]):
        the layer appends them, their gate output is written beside them, and the attention
        function is handed a note to attend over the layer (``attend``)."""
        self.layers[layer_idx].update(key_states, value_states, self.ledger)
        if self.gates is not None:
            b, _, q, _ = key_states.shape
            log_beta = self.gate_handoff.take(layer_idx, b, q)
            if log_beta is not None:  # None: a decode step's gate, run at the end of the forward
                self.store_log_beta(layer_idx, log_beta)
        handoff.hand_over(self, layer_idx)
        return key_states, value_states

    def attend(self, layer_idx: int, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """Attention of the new queries over what layer ``layer_idx`` holds; [B, Q, Hq, D] (called by
        the attention function the note of ``update`` reached)."""
        layer = self.layers[layer_idx]
        out = layer.attend(query, scaling, self.scorer.for_layer(layer_idx), self.paths)
        if query.shape[2] > 1:
            self.after_prefill_attention(layer)
        return out

    def store_log_beta(self, layer_idx: int, log_beta: torch.Tensor) -> None:
        """Write the gate output of the newest ``log_beta.shape[-1]`` tokens of ``layer_idx``
        ([B, H, Q]): the one way log betas reach the stores, from a prefill or a decode step."""
        self.layers[layer_idx].store.set_tail_state("log_beta", log_beta)

    def is_empty(self) -> bool:
        """No layer has seen a token yet."""
        return all(layer.seen == 0 for layer in self.layers)

    def after_prefill_attention(self, layer: CompressedLayer) -> None:
        """A layer attended over several new tokens: evict from it (or route it between tiers) now
        rather than at the end of the forward, so the prompt's keys and values never fill every layer.

        Only a call that started on an empty cache does this (a prompt, or each chunk of a prompt
        fed in chunks): if it fails half-way, undoing it means emptying the cache, and nothing
        held before the call is lost. A new turn on a non-empty cache evicts at the end of its
        forward (``prefill_chunk`` bounds what it holds meanwhile). A tiered cache under a global
        allocation (its ranking spans every layer) routes at the end too, but sends each layer's
        entries that can no longer be FP to INT2 as soon as it has run (``vlm_kv.tiers.global_prefill``)."""
        if self._evicts_at_end:
            return
        start = time.perf_counter()
        if self._layerwise is None:
            if self.router is not None:
                self._layerwise = self.router.begin_layerwise(self.evictor, self.ledger, self.num_layers)
            else:
                self._layerwise = self.evictor.begin_layerwise(self.ledger, self.num_layers)
            if self._layerwise is None:  # not splittable by layer: the end-of-forward step does it all
                self._evicts_at_end = True
                return
        self.peak_kv_bytes = max(self.peak_kv_bytes, report.total_kv_bytes(self))
        on_cpu = layer.store is not None and layer.store.device.type == "cpu"
        held_before = layer.kv_bytes() if on_cpu else 0
        if self.router is not None:
            self.router.route_layer(self._layerwise, layer)
        else:
            self.evictor.evict_layer(self._layerwise, layer, self.ledger)
        if on_cpu:
            # what the layers free would otherwise stay in the process as freed heap, so its resident
            # set would grow layer after layer as if nothing were evicted; a trim costs a few ms, so
            # only once enough was freed (glibc maps tensors above 32 MiB itself and returns those)
            self._freed_since_trim += max(0, held_before - layer.kv_bytes())
            if self._freed_since_trim >= HEAP_TRIM_BYTES:
                return_freed_heap()
                self._freed_since_trim = 0
        self.evict_seconds += time.perf_counter() - start

    def end_forward(self) -> None:
        """After each forward (the model post-hook): check hand-offs, then evict if it is time."""
        handoff.end_forward()
        self.gate_handoff.check_consumed()
        for layer_idx, log_beta in self.gate_handoff.deferred_log_betas():
            self.store_log_beta(layer_idx, log_beta)
        q = self.ledger.end_forward()
        if q and self.evictor.due(q, prompt=self._fresh_forward):
            self.peak_kv_bytes = max(self.peak_kv_bytes, report.total_kv_bytes(self))
            self.evict()

    def abort_forward(self) -> None:
        """The forward raised: drop its hand-offs and the tokens some layers already stored, so the
        cache is as it was before the call (nothing of what it held is lost)."""
        handoff.end_forward_quietly()
        self.gate_handoff.clear()
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
                layer.drop_newest(extra)

    @torch.no_grad()
    def evict(self) -> None:
        """One eviction step over every layer; afterwards the cache holds at most its budget."""
        layers = [layer for layer in self.layers if layer.store is not None]
        if not layers or self.ledger.valid_tokens is None:
            return
        start = time.perf_counter()
        step, self._layerwise = self._layerwise, None
        if self.router is not None and step is not None:
            self.router.finish_layerwise(step, layers)
        elif self.router is not None:
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
            if layer.store is not None:
                layer.bound_spare_room(by_budget)

    def reset(self) -> None:
        """Empty the cache for a new conversation: every layer and what the ledger counted."""
        super().reset()
        self.ledger.reset()
        self.gate_handoff.clear()
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
