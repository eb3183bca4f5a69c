"""A layer of a tiered cache: full-precision entries in its store, INT2 windows in its tier.

The tier router (``vlm_kv.tiers``) moves windows between the two at each routing event; this
layer builds its tier beside its store, attends over both in one softmax, and counts both.
"""

from __future__ import annotations

import torch

from vlm_kv.attention import backend, decode, reference
from vlm_kv.attention.backend import AttentionPaths
from vlm_kv.cache.layer import CompressedLayer, LayerSpec
from vlm_kv.policies.base import Scorer
from vlm_kv.storage.store import VarlenKVStore
from vlm_kv.tiers.int2_tier import Int2Tier
from vlm_kv.tiers.window_router import merge_views

__all__ = ["TieredLayer"]


class _TieredEntries:
    """Where a scorer's observation lands when its view spans the FP store and the INT2 tier:
    the first ``fp_length`` columns belong to the store, the rest to the tier's windows."""

    def __init__(self, store: VarlenKVStore, tier: Int2Tier, fp_length: int, slot: torch.Tensor) -> None:
        self.store, self.tier, self.fp_length, self.slot = store, tier, fp_length, slot

    def add_state(self, name: str, padded: torch.Tensor) -> None:
        self.store.add_state(name, padded[..., : self.fp_length])
        self.tier.add_state(name, padded[..., self.fp_length :], self.slot)


class TieredLayer(CompressedLayer):
    """A compressed layer with an INT2 tier (``spec.tiers``) and its ledger of windows."""

    def __init__(self, spec: LayerSpec, layer_idx: int) -> None:
        if spec.tiers is None:
            raise ValueError("a tiered layer needs the tier settings (LayerSpec.tiers)")
        super().__init__(spec, layer_idx)
        self.tier: Int2Tier | None = None  # built with the store, from the first keys

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.tier = Int2Tier.for_keys(key_states, self.spec.tiers, self.spec.state_names, rope=self.spec.key_rotation)

    def _attention(self, query: torch.Tensor, query_positions: torch.Tensor, scaling: float | None, scorer: Scorer,
                   paths: AttentionPaths) -> torch.Tensor:
        """One softmax over the FP entries and the dequantized INT2 windows; scorers observe both.
        With no INT2 window yet, the FP paths."""
        tier, store = self.tier, self.store
        if not tier.num_active:
            return super()._attention(query, query_positions, scaling, scorer, paths)
        if (query.shape[2] == 1 and paths.triton_decode(query) and store.tail_all_valid
                and tier.kernel_readable and not scorer.observes):
            return backend.tiered_decode_attention_triton(query, store, tier, scaling)
        if self._decodes_in_place(query, scorer):
            # read both tiers where they lie (no per-row padded copy), rotating the query and the
            # INT2 output rather than every INT2 entry (as the kernel does)
            if paths.cpu_int2_decode(query):
                return backend.tiered_decode_attention_cpu(query, store, tier.packed_windows(), tier.key_basis,
                                                           tier.value_basis, scaling)
            return decode.decode_attention_with_rotated(query, store, tier.rotated_entries(), tier.key_basis,
                                                        tier.value_basis, scaling)
        fp = store.padded_view(with_values=True)
        tv = tier.view(with_values=True, dtype=query.dtype)
        view, _ = merge_views(fp, tv.view, sort=False)
        out = reference.varlen_attention(query, view, query_positions, scaling)
        if scorer.observes:
            scorer.observe(_TieredEntries(store, tier, fp.length, tv.slot), query, view, query_positions, scaling)
        return out

    def _decodes_in_place(self, query: torch.Tensor, scorer: Scorer) -> bool:
        """A decode step read where the entries lie: post-RoPE codes (pre-RoPE ones are rotated per
        position in the merged view) and a scorer that does not observe the attention."""
        return query.shape[2] == 1 and self.tier.rope is None and not scorer.observes

    # ------------------------------------------------------------ what it holds, over both tiers
    def num_entries(self) -> int:
        if self.store is None:
            return 0
        return self.store.num_entries() + self.tier.num_entries()

    def held_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        positions, tier = super().held_positions()
        if self.tier.num_active:
            tv = self.tier.view(with_values=False).view
            positions = torch.cat([positions, tv.positions.masked_fill(~tv.valid, -1)], dim=2)
            tier = torch.cat([tier, torch.ones_like(tv.positions, dtype=torch.uint8)], dim=2)
        return positions, tier

    def head_lengths(self) -> torch.Tensor:
        return super().head_lengths() + self.tier.entries_per_row().cpu()

    def kv_bytes(self) -> int:
        if self.store is None:
            return 0
        return self.store.kv_bytes() + sum(self.tier.tier_bytes().values())

    def meta_bytes(self) -> int:
        if self.store is None:
            return 0
        return self.store.meta_bytes() + self.tier.meta_bytes()

    def reset(self) -> None:
        super().reset()
        self.tier = None

    def _repeat_batch(self, repeats: int) -> None:
        super()._repeat_batch(repeats)
        self.tier.repeat_batch(repeats)
