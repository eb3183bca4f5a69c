"""One decoder layer's compressed KV cache, as a transformers cache layer.

As in transformers' ``cache_utils``, a layer owns its state (its store, the tokens it has seen,
its recent queries) and knows nothing of its container: what it needs from the policy is a
``LayerSpec`` given at construction, and what each call needs (the token ledger, the layer's
scorer, the attention paths) is passed in by the ``CompressedCache`` that orchestrates them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from vlm_kv.attention import backend, decode, reference
from vlm_kv.attention.backend import AttentionPaths
from vlm_kv.config import TierConfig
from vlm_kv.policies.base import Scorer
from vlm_kv.storage.ledger import CacheMisuseError, TokenLedger
from vlm_kv.storage.store import VarlenKVStore, tensor_bytes
from vlm_kv.tiers.rope_keys import KeyRotation

__all__ = ["CompressedLayer", "LayerSpec", "QueryRing"]


@dataclass(frozen=True)
class LayerSpec:
    """What a layer needs from its cache's policy, fixed when the cache is built."""

    state_names: tuple[str, ...] = ()  # per-entry policy state the store keeps beside each entry
    tail_reserve: int = 16             # the eviction interval: decode steps grow the tail this far
    tiers: TierConfig | None = None    # the INT2 tier's settings (tiered layers only)
    key_rotation: KeyRotation | None = None  # pre-RoPE INT2 keys (tiers.key_rope == "pre")


class QueryRing:
    """The most recent queries of one layer and their positions, for observation-window scorers.

    The ring grows with the queries seen, up to the window, so a short prompt does not hold a
    whole window of empty slots; until it is full it fills in order (the next slot is the count
    held), so growing keeps every query where it is."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.queries: torch.Tensor | None = None    # [B, Hq, <= w, D]
        self.positions: torch.Tensor | None = None  # [<= w] long
        self.filled = 0
        self.next = 0

    def remember(self, query: torch.Tensor, positions: torch.Tensor, window: int) -> None:
        """Keep the last ``window`` of ``query`` [B, Hq, Q, D] (positions [Q]); nothing if window <= 0."""
        if window <= 0:
            return
        n = min(query.shape[2], window)
        self._grow(query, min(window, self.filled + n))
        if n == 1:  # a decode step: one slot, no index tensors
            slot = self.next
            self.queries[:, :, slot] = query[:, :, -1]
            self.positions[slot] = positions[-1]
        else:
            slots = (self.next + torch.arange(n, device=query.device)) % window
            self.queries.index_copy_(2, slots, query[:, :, -n:])
            self.positions.index_copy_(0, slots, positions[-n:])
        self.next = (self.next + n) % window
        self.filled = min(window, self.filled + n)

    def _grow(self, query: torch.Tensor, size: int) -> None:
        if self.queries is not None and self.queries.shape[2] >= size:
            return
        b, hq, _, d = query.shape
        queries = torch.zeros(b, hq, size, d, dtype=query.dtype, device=query.device)
        positions = torch.zeros(size, dtype=torch.long, device=query.device)
        if self.queries is not None:
            held = self.filled
            queries[:, :, :held] = self.queries[:, :, :held]
            positions[:held] = self.positions[:held]
        self.queries, self.positions = queries, positions

    @property
    def window_queries(self) -> torch.Tensor | None:
        return None if self.queries is None else self.queries[:, :, : self.filled]

    @property
    def window_positions(self) -> torch.Tensor | None:
        return None if self.queries is None else self.positions[: self.filled]

    def nbytes(self) -> int:
        return tensor_bytes(self.queries, self.positions)

    def repeat_batch(self, repeats: int) -> None:
        if self.queries is not None:
            self.queries = self.queries.repeat_interleave(repeats, dim=0)


class CompressedLayer(CacheLayerMixin):
    """One decoder layer's compressed KV cache: its store, its recent queries, its attention."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, spec: LayerSpec, layer_idx: int) -> None:
        super().__init__()
        self.spec = spec
        self.layer_idx = layer_idx
        self.store: VarlenKVStore | None = None
        self.seen = 0
        self.scaling: float | None = None
        self.recent = QueryRing()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.device = key_states.device
        self.store = VarlenKVStore(b, h, d, key_states.dtype, key_states.device, self.spec.state_names,
                                   tail_reserve=self.spec.tail_reserve)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, ledger: TokenLedger, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new tokens in place; ``ledger`` says what they are (modality, padding)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, _, q, _ = key_states.shape
        if b != self.store.batch_size:
            raise CacheMisuseError(
                f"batch size changed from {self.store.batch_size} to {b}; a compressed cache serves one batch "
                "(beam search is not supported)"
            )
        record = ledger.enter(b, q, key_states.device)
        self.store.append(key_states, value_states, self.seen, record.modality, record.valid, record.all_valid)
        self.seen += q
        return key_states, value_states

    def drop_newest(self, count: int) -> None:
        """Forget the ``count`` newest tokens (a forward that raised after this layer stored them)."""
        self.store.drop_newest(count)
        self.seen -= count

    # ------------------------------------------------------------ attention
    def attend(self, query: torch.Tensor, scaling: float | None, scorer: Scorer, paths: AttentionPaths) -> torch.Tensor:
        """Attention of the new queries over what this layer holds; [B, Q, Hq, D]. ``scorer`` (this
        layer's) observes the attention; ``paths`` says which compiled kernels may run."""
        q = query.shape[2]
        self.scaling = scaling
        query_positions = self.store.tail_positions[-q:].long()
        out = self._attention(query, query_positions, scaling, scorer, paths)
        self.recent.remember(query, query_positions, scorer.query_window)
        return out

    def _attention(self, query: torch.Tensor, query_positions: torch.Tensor, scaling: float | None, scorer: Scorer,
                   paths: AttentionPaths) -> torch.Tensor:
        """Over the full-precision store: the Triton or PyTorch decode, the varlen prefill, or the reference."""
        store = self.store
        q = query.shape[2]
        if q == 1 and paths.triton_decode(query) and store.tail_all_valid and not scorer.uses_received_attention:
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
        elif store.body_size and store.tail_all_valid and paths.flash_prefill(query):
            out = backend.prefill_attention_paged(query, store, scaling, backend="flash")
            if scorer.observes:
                view = store.padded_view(with_values=False, with_modality=False)
                scorer.observe(store, query, view, query_positions, scaling)
        else:
            view = store.padded_view(with_values=True, with_modality=False)
            dense = store.body_size == 0 and store.tail_all_valid
            out = reference.varlen_attention(query, view, query_positions, scaling, dense)
            scorer.observe(store, query, view, query_positions, scaling)
        return out

    @property
    def window_queries(self) -> torch.Tensor | None:
        """[B, Hq, w, D] the most recent queries (in ring order; scorers sum over them)."""
        return self.recent.window_queries

    @property
    def window_positions(self) -> torch.Tensor | None:
        return self.recent.window_positions

    # ------------------------------------------------------------ what it holds
    def num_entries(self) -> int:
        """Entries held in every tier."""
        return 0 if self.store is None else self.store.num_entries()

    def held_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Original positions of every entry this layer holds, per (batch, kv head), and their tier.

        Returns ``(positions [B, H, L] long, -1 where a row is shorter; tier [B, H, L] uint8,
        0 = full precision, 1 = INT2)``. Diagnostics compare these sets between eviction steps.
        """
        if self.store is None:
            raise CacheMisuseError(f"layer {self.layer_idx} holds nothing yet (no forward ran)")
        view = self.store.padded_view(with_values=False, with_modality=False)
        positions = view.positions.masked_fill(~view.valid, -1)
        return positions, torch.zeros_like(positions, dtype=torch.uint8)

    def head_lengths(self) -> torch.Tensor:
        """[B * H] entries held per KV head over every tier, on the CPU (the store must exist)."""
        return self.store.head_lengths().flatten().cpu()

    def query_window_bytes(self) -> int:
        return self.recent.nbytes()

    def kv_bytes(self) -> int:
        """Key/value bytes this layer holds, over its tiers."""
        return 0 if self.store is None else self.store.kv_bytes()

    def meta_bytes(self) -> int:
        """Bytes of entry metadata over its tiers (positions, modality, state, bookkeeping)."""
        return 0 if self.store is None else self.store.meta_bytes()

    def held_bytes(self) -> int:
        """Everything this layer keeps: keys and values over its tiers, their metadata, its remembered queries."""
        if self.store is None:
            return 0
        return self.kv_bytes() + self.meta_bytes() + self.query_window_bytes()

    def full_bytes(self) -> int:
        """Bytes a DynamicCache layer would hold for the tokens this layer has seen (padding included)."""
        if self.store is None:
            return 0
        return self.store.batch_size * self.store.num_kv_heads * self.seen * self.store.bytes_per_entry

    def bound_spare_room(self, tokens_per_head: int) -> None:
        """Spare tail room per head until the next eviction step: at most ``tokens_per_head``, and at
        most what the room this layer freed (against a DynamicCache's bytes) pays for."""
        room = self.full_bytes() - self.held_bytes()
        self.store.spare_limit = max(0, min(tokens_per_head, room // self.store.slot_bytes()))

    # ------------------------------------------------------------ transformers' layer interface
    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.store = None
        self.seen = 0
        self.recent.reset()
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        raise CacheMisuseError("a compressed cache cannot be cropped: evicted entries are gone")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise CacheMisuseError("beam search is not supported by the compressed cache")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats == 1 or self.store is None:
            return
        self._repeat_batch(repeats)
        self.recent.repeat_batch(repeats)

    def _repeat_batch(self, repeats: int) -> None:
        """Repeat every sequence's entries in each tier (rows b -> b*repeats .. b*repeats+repeats-1)."""
        self.store.repeat_batch(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise CacheMisuseError("batch selection is not supported by the compressed cache")
