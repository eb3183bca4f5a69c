"""Per-layer KV storage with per-head variable lengths.

Between two eviction steps every KV head receives exactly the same new tokens, so a layer's
store has two parts:

* the *body*: what past eviction steps kept. Heads hold different numbers of entries, laid end
  to end in one flat ``[N, head_dim]`` tensor (row ``b * H + h`` owns a contiguous run), with the
  original position, modality and policy state of every entry beside it;
* the *tail*: tokens seen since the last eviction step, dense ``[B, H, T, head_dim]`` because it
  is the same length for every head.

An eviction step merges both, keeps what the policy chose and writes a new flat body, so evicted
entries leave memory. ``padded_view`` lays body and tail side by side per head, left aligned,
for attention and scoring: a transient working copy, never what is kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vlm_kv.models.adapters import MODALITIES


@dataclass
class PaddedView:
    """Body and tail of one layer, one row per (batch, kv head), left aligned.

    ``keys``/``values``: [B, H, L, D]; ``positions``: [B, H, L] (int64, -1 where empty);
    ``modality``: [B, H, L] uint8; ``valid``: [B, H, L] bool; ``state``: name -> [B, H, L] float32.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    modality: torch.Tensor
    valid: torch.Tensor
    state: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return self.keys.shape[2]


class VarlenKVStore:
    """Keys, values and per-entry metadata of one layer, compact per KV head."""

    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        state_names: tuple[str, ...] = (),
    ) -> None:
        self.batch_size = batch_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.state_names = tuple(state_names)
        rows = batch_size * num_kv_heads
        self.body_keys = torch.empty(0, head_dim, dtype=dtype, device=device)
        self.body_values = torch.empty(0, head_dim, dtype=dtype, device=device)
        self.body_positions = torch.empty(0, dtype=torch.int32, device=device)
        self.body_modality = torch.empty(0, dtype=torch.uint8, device=device)
        self.body_state = {n: torch.empty(0, dtype=torch.float32, device=device) for n in self.state_names}
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)
        self._rows = torch.empty(0, dtype=torch.long, device=device)
        self._cols = torch.empty(0, dtype=torch.long, device=device)
        self.tail_keys = torch.empty(batch_size, num_kv_heads, 0, head_dim, dtype=dtype, device=device)
        self.tail_values = torch.empty_like(self.tail_keys)
        self.tail_positions = torch.empty(0, dtype=torch.int32, device=device)
        self.tail_modality = torch.empty(batch_size, 0, dtype=torch.uint8, device=device)
        self.tail_valid = torch.empty(batch_size, 0, dtype=torch.bool, device=device)
        self.tail_state = {
            n: torch.empty(batch_size, num_kv_heads, 0, dtype=torch.float32, device=device) for n in self.state_names
        }

    # ------------------------------------------------------------------ sizes
    @property
    def body_size(self) -> int:
        return self.body_keys.shape[0]

    @property
    def tail_size(self) -> int:
        return self.tail_keys.shape[2]

    @property
    def bytes_per_entry(self) -> int:
        return 2 * self.head_dim * self.body_keys.element_size()

    def num_entries(self) -> int:
        return self.body_size + self.batch_size * self.num_kv_heads * self.tail_size

    def kv_bytes(self) -> int:
        """Bytes allocated for keys and values (body and tail)."""
        return sum(t.numel() * t.element_size() for t in (self.body_keys, self.body_values, self.tail_keys, self.tail_values))

    def meta_bytes(self) -> int:
        """Bytes of positions, modality, policy state and index bookkeeping."""
        tensors = [self.body_positions, self.body_modality, self.lengths, self._rows, self._cols,
                   self.tail_positions, self.tail_modality, self.tail_valid]
        tensors += list(self.body_state.values()) + list(self.tail_state.values())
        return sum(t.numel() * t.element_size() for t in tensors)

    def modality_counts(self) -> torch.Tensor:
        """Entries held per modality code (pads in the tail count as text: they use memory too)."""
        counts = torch.bincount(self.body_modality.long(), minlength=len(MODALITIES))[: len(MODALITIES)]
        if self.tail_size:
            tail = torch.bincount(self.tail_modality.reshape(-1).long(), minlength=len(MODALITIES))[: len(MODALITIES)]
            counts = counts + tail * self.num_kv_heads
        return counts

    def head_lengths(self) -> torch.Tensor:
        """[B, H] entries held per KV head (tail pads included)."""
        return (self.lengths + self.tail_size).view(self.batch_size, self.num_kv_heads)

    # ----------------------------------------------------------------- writes
    def append(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        modality: torch.Tensor,
        valid: torch.Tensor,
    ) -> None:
        """Add new tokens to the tail. keys/values: [B, H, Q, D]; positions: [Q]; modality/valid: [B, Q]."""
        q = keys.shape[2]
        self.tail_keys = torch.cat([self.tail_keys, keys.to(self.dtype)], dim=2)
        self.tail_values = torch.cat([self.tail_values, values.to(self.dtype)], dim=2)
        self.tail_positions = torch.cat([self.tail_positions, positions.to(self.device, torch.int32)])
        self.tail_modality = torch.cat([self.tail_modality, modality.to(self.device, torch.uint8)], dim=1)
        self.tail_valid = torch.cat([self.tail_valid, valid.to(self.device, torch.bool)], dim=1)
        for name in self.state_names:
            zeros = torch.zeros(self.batch_size, self.num_kv_heads, q, dtype=torch.float32, device=self.device)
            self.tail_state[name] = torch.cat([self.tail_state[name], zeros], dim=2)

    def set_tail_state(self, name: str, values: torch.Tensor) -> None:
        """Overwrite the state of the newest ``values.shape[-1]`` tail entries ([B, H, Q])."""
        q = values.shape[-1]
        self.tail_state[name][..., -q:] = values.to(torch.float32)

    def add_state(self, name: str, padded: torch.Tensor) -> None:
        """Add a padded [B, H, L] quantity (laid out like ``padded_view``) to the entries' state."""
        rows = self.batch_size * self.num_kv_heads
        flat = padded.reshape(rows, -1)
        if self.body_size:
            self.body_state[name] += flat[self._rows, self._cols]
        if self.tail_size:
            cols = self.lengths[:, None] + torch.arange(self.tail_size, device=self.device)[None]
            tail = flat.gather(1, cols)
            self.tail_state[name] += tail.view(self.batch_size, self.num_kv_heads, -1)

    # ------------------------------------------------------------------ views
    def padded_view(
        self, with_values: bool = True, states: tuple[str, ...] = (), with_modality: bool = True
    ) -> PaddedView:
        """Body then tail per (batch, head) row, left aligned, padded to the longest row.

        Attention needs only keys, values, positions and validity; scoring and compaction
        ask for modality and policy state too.
        """
        B, H, T = self.batch_size, self.num_kv_heads, self.tail_size
        dev = self.device
        tail_valid = self.tail_valid[:, None, :].expand(B, H, T)
        tail_pos = self.tail_positions.long()[None, None, :].expand(B, H, T)
        tail_mod = self.tail_modality[:, None, :].expand(B, H, T)
        if self.body_size == 0:
            return PaddedView(
                keys=self.tail_keys,
                values=self.tail_values if with_values else self.tail_values[..., :0],
                positions=tail_pos,
                modality=tail_mod,
                valid=tail_valid,
                state={n: self.tail_state[n] for n in states},
            )
        rows = B * H
        longest = int(self.lengths.max()) + T
        tail_cols = self.lengths[:, None] + torch.arange(T, device=dev)[None]
        row_ids = torch.arange(rows, device=dev)[:, None].expand(rows, T)

        def lay(body: torch.Tensor, tail: torch.Tensor, fill, dtype) -> torch.Tensor:
            shape = (rows, longest) + tuple(body.shape[1:])
            out = torch.full(shape, fill, dtype=dtype, device=dev) if fill != 0 else torch.zeros(shape, dtype=dtype, device=dev)
            out[self._rows, self._cols] = body.to(dtype)
            if T:
                out[row_ids, tail_cols] = tail.reshape((rows, T) + tuple(body.shape[1:])).to(dtype)
            return out.view((B, H, longest) + tuple(body.shape[1:]))

        keys = lay(self.body_keys, self.tail_keys, 0, self.dtype)
        values = lay(self.body_values, self.tail_values, 0, self.dtype) if with_values else keys[..., :0]
        ones = torch.ones(self.body_size, dtype=torch.bool, device=dev)
        valid = lay(ones, tail_valid, 0, torch.bool)
        positions = lay(self.body_positions.long(), tail_pos, -1, torch.long)
        modality = lay(self.body_modality, tail_mod, 0, torch.uint8) if with_modality else valid[..., :0]
        state = {n: lay(self.body_state[n], self.tail_state[n], 0, torch.float32) for n in states}
        return PaddedView(keys, values, positions, modality, valid, state)

    # -------------------------------------------------------------- eviction
    def compact(self, keep: torch.Tensor, view: PaddedView | None = None) -> None:
        """Keep the entries marked in ``keep`` ([B, H, L], laid out like ``padded_view``) and free the rest."""
        if view is None:
            view = self.padded_view(states=self.state_names)
        B, H = self.batch_size, self.num_kv_heads
        rows = B * H
        keep = (keep & view.valid).reshape(rows, -1)
        flat_keep = keep.reshape(-1)

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t.reshape((rows * view.length,) + tuple(t.shape[3:]))[flat_keep].contiguous()

        self.body_keys = pick(view.keys)
        self.body_values = pick(view.values)
        self.body_positions = pick(view.positions).to(torch.int32)
        self.body_modality = pick(view.modality)
        self.body_state = {
            n: pick(view.state[n]) if n in view.state else torch.zeros(self.body_keys.shape[0], device=self.device)
            for n in self.state_names
        }
        self.lengths = keep.sum(dim=1)
        self._rows = torch.repeat_interleave(torch.arange(rows, device=self.device), self.lengths)
        starts = torch.cumsum(self.lengths, 0) - self.lengths
        self._cols = torch.arange(self.body_size, device=self.device) - starts[self._rows]
        self.tail_keys = self.tail_keys[:, :, :0].contiguous()
        self.tail_values = self.tail_values[:, :, :0].contiguous()
        self.tail_positions = self.tail_positions[:0]
        self.tail_modality = self.tail_modality[:, :0]
        self.tail_valid = self.tail_valid[:, :0]
        self.tail_state = {n: t[..., :0] for n, t in self.tail_state.items()}
