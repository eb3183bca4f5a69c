"""Per-layer KV storage with per-head variable lengths, persistent between eviction steps.

Between two eviction steps every KV head receives exactly the same new tokens, so a layer's
store has two parts:

* the *body*: what past eviction steps kept. Heads hold different numbers of entries, laid end
  to end in one flat ``[N, head_dim]`` tensor sorted by row (row ``b * H + h`` owns the run
  ``row_starts[r] : row_starts[r] + lengths[r]``), with each entry's original position, modality
  and policy state beside it. It is written once per eviction step, to its exact size;
* the *tail*: tokens seen since the last eviction step, dense ``[B, H, T, head_dim]`` because
  it is the same length for every head. It lives in a buffer with spare capacity, so a decode
  step writes its token in place (amortized O(1)); an eviction step releases the buffer.

Attention reads body and tail where they lie (``vlm_kv.attention``): no padded copy is built
on a decode step. ``padded_view`` lays body and tail side by side per head, left aligned; it is
a transient working copy for eviction steps and multi-token prefill, never what is kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vlm_kv.models.adapters import MODALITIES


def own_head_bias(entry_head: torch.Tensor, num_kv_heads: int, group: int) -> torch.Tensor:
    """[num_kv_heads * group, n] float32 additive mask: 0 where entry j (of KV head
    ``entry_head[j]``) belongs to query head i's KV head (``i // group``), -inf elsewhere."""
    query_head = torch.arange(num_kv_heads * group, device=entry_head.device) // group
    own = entry_head.long()[None, :] == query_head[:, None]
    return torch.zeros(own.shape, dtype=torch.float32, device=entry_head.device).masked_fill_(~own, float("-inf"))


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    """Bytes of storage the tensors hold (their whole storage, not just the viewed part)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen and key != 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


@dataclass
class Entries:
    """Loose entries to insert into a store: row (b * H + h) [n], keys/values [n, D], positions [n],
    modality [n], state name -> [n]."""

    rows: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    modality: torch.Tensor
    state: dict[str, torch.Tensor] = field(default_factory=dict)


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


@dataclass(frozen=True)
class EntrySource:
    """Keys and values of a store's entries addressed as ``padded_view`` lays them out, read from
    where they lay when it was made (``VarlenKVStore.entry_source``). Why: a routing event moves a few
    entries of each layer, and reading just those costs less than laying out every key and value.
    It holds the tensors of that moment, so a later compaction (which writes new ones) cannot move
    what it reads; no step writes into them in place while an event runs."""

    body_keys: torch.Tensor    # [N, D]
    body_values: torch.Tensor  # [N, D]
    row_starts: torch.Tensor   # [B * H]
    lengths: torch.Tensor      # [B * H] body entries of each row
    tail_keys: torch.Tensor    # [B, H, T, D]
    tail_values: torch.Tensor  # [B, H, T, D]

    def read(self, b: torch.Tensor, h: torch.Tensor, col: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [n, D] of the entries at (b, h, col) of the padded layout (valid ones only)."""
        H = self.tail_keys.shape[1]
        row = b * H + h
        body_len = self.lengths[row]
        in_body = col < body_len
        if bool(in_body.all()):
            at = self.row_starts[row] + col
            return self.body_keys[at], self.body_values[at]
        n, D = col.numel(), self.body_keys.shape[-1]
        keys = torch.empty(n, D, dtype=self.body_keys.dtype, device=col.device)
        values = torch.empty(n, D, dtype=self.body_values.dtype, device=col.device)
        i = torch.nonzero(in_body).flatten()
        at = self.row_starts[row[i]] + col[i]
        keys[i], values[i] = self.body_keys[at], self.body_values[at]
        i = torch.nonzero(~in_body).flatten()
        t = col[i] - body_len[i]
        keys[i], values[i] = self.tail_keys[b[i], h[i], t], self.tail_values[b[i], h[i], t]
        return keys, values


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
        tail_reserve: int = 16,
    ) -> None:
        self.batch_size = batch_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.state_names = tuple(state_names)
        # decode steps grow the tail buffer by this many tokens at a time (the eviction interval) ...
        self.tail_reserve = max(1, tail_reserve)
        # ... but never by more spare room than the owner allows (``spare_limit`` tokens per head:
        # what the budget and the room evictions freed allow, set after every eviction step)
        self.spare_limit = 0
        rows = batch_size * num_kv_heads
        self.body_keys = torch.empty(0, head_dim, dtype=dtype, device=device)
        self.body_values = torch.empty(0, head_dim, dtype=dtype, device=device)
        self.body_positions = torch.empty(0, dtype=torch.int32, device=device)
        self.body_modality = torch.empty(0, dtype=torch.uint8, device=device)
        self.body_state = {n: torch.empty(0, dtype=torch.float32, device=device) for n in self.state_names}
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)
        self._set_layout(self.lengths)
        self.tail_size = 0
        self._release_tail()

    # ------------------------------------------------------------------ layout
    def _set_layout(self, lengths: torch.Tensor) -> None:
        """Row bookkeeping derived from the per-row lengths of a freshly written body."""
        rows = lengths.numel()
        self.lengths = lengths
        self.row_starts = torch.cumsum(lengths, 0) - lengths
        # row and column of every body entry, int32 (8 bytes an entry instead of 16: bookkeeping that
        # grows with the entries counts in the cache's held bytes)
        self._rows = torch.repeat_interleave(torch.arange(rows, device=self.device, dtype=torch.int32), lengths)
        self._cols = (torch.arange(self._rows.numel(), device=self.device) - self.row_starts[self._rows]).int()
        lens = lengths.tolist()
        self.max_length = max(lens) if lens else 0
        # Uniform allocations give every head the same length: the body is then a dense
        # [B, H, L, D] block and attention reads it as a view.
        self.uniform = len(set(lens)) <= 1
        self._batch_spans = [
            (int(self.row_starts[b * self.num_kv_heads]) if lens else 0,
             sum(lens[b * self.num_kv_heads:(b + 1) * self.num_kv_heads]))
            for b in range(self.batch_size)
        ]
        # local kv-head index of every body entry (ragged attention masks with it)
        self.entry_head = (self._rows % self.num_kv_heads).to(torch.int16) if not self.uniform else None
        self._body_table = None  # built on first use by a paged kernel
        self._head_bias: dict[tuple[int, int], torch.Tensor] = {}  # built on first use by ragged decode

    def head_bias(self, b: int, group: int) -> torch.Tensor:
        """[H * group, n] float32 additive mask for batch row ``b``'s flat body: 0 where an entry
        belongs to the KV head of the query head, -inf elsewhere. Kept until the next layout
        change, so decode steps between evictions do not rebuild it."""
        key = (b, group)
        if key not in self._head_bias:
            start, count = self._batch_spans[b]
            heads = self.entry_head if self.entry_head is not None else self._rows % self.num_kv_heads
            self._head_bias[key] = own_head_bias(heads[start : start + count], self.num_kv_heads, group)
        return self._head_bias[key]

    def paged_body(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The body as a paged source with one-entry blocks: (keys [N, 1, D], values [N, 1, D],
        [rows, max_length] int32 entry index, [rows] int32 lengths), read in place."""
        table, lengths = self.body_table()
        d = self.head_dim
        return self.body_keys.view(-1, 1, d), self.body_values.view(-1, 1, d), table, lengths

    def paged_tail(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tail buffer as a paged source with one-entry blocks, read in place: (keys
        [rows * capacity, 1, D], values, [rows, tail_size] int32 entry index, [rows] int32 lengths)."""
        rows, cap, T, d = self.batch_size * self.num_kv_heads, self.tail_capacity, self.tail_size, self.head_dim
        dev = self._tail_k.device
        table = (torch.arange(rows, device=dev) * cap)[:, None] + torch.arange(T, device=dev)[None]
        return (self._tail_k.view(-1, 1, d), self._tail_v.view(-1, 1, d), table.to(torch.int32),
                torch.full((rows,), T, dtype=torch.int32, device=dev))

    def body_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The body as a paged store with one-entry blocks: ([rows, max_length] int32 entry index, [rows] int32 lengths)."""
        if self._body_table is None:
            cols = torch.arange(max(self.max_length, 1), device=self.device)
            table = (self.row_starts[:, None] + cols[None, :]).clamp(max=max(self.body_size - 1, 0))
            self._body_table = (table.to(torch.int32), self.lengths.to(torch.int32))
        return self._body_table

    def _release_tail(self) -> None:
        B, H, D = self.batch_size, self.num_kv_heads, self.head_dim
        dev = self.device
        self._tail_k = torch.empty(B, H, 0, D, dtype=self.dtype, device=dev)
        self._tail_v = torch.empty(B, H, 0, D, dtype=self.dtype, device=dev)
        self._tail_pos = torch.empty(0, dtype=torch.int32, device=dev)
        self._tail_mod = torch.empty(B, 0, dtype=torch.uint8, device=dev)
        self._tail_valid = torch.empty(B, 0, dtype=torch.bool, device=dev)
        self._tail_state = {n: torch.empty(B, H, 0, dtype=torch.float32, device=dev) for n in self.state_names}
        self.tail_size = 0
        self.tail_all_valid = True

    def _grow_tail(self, needed: int, reserve: bool) -> None:
        cap = self._tail_k.shape[2]
        if needed <= cap:
            return
        # decode steps reserve room up to the next eviction step (the tail never needs more than
        # tail_reserve tokens), within the spare room allowed; a prefill takes what it needs
        spare = self.spare_limit if reserve else 0
        new_cap = max(needed, min(self.tail_reserve, needed + spare))
        T = self.tail_size

        def grow(t: torch.Tensor, dim: int, fill=0) -> torch.Tensor:
            shape = list(t.shape)
            shape[dim] = new_cap
            out = torch.full(shape, fill, dtype=t.dtype, device=t.device) if fill else torch.zeros(shape, dtype=t.dtype, device=t.device)
            out.narrow(dim, 0, T).copy_(t.narrow(dim, 0, T))
            return out

        self._tail_k = grow(self._tail_k, 2)
        self._tail_v = grow(self._tail_v, 2)
        self._tail_pos = grow(self._tail_pos, 0)
        self._tail_mod = grow(self._tail_mod, 1)
        self._tail_valid = grow(self._tail_valid, 1)
        self._tail_state = {n: grow(t, 2) for n, t in self._tail_state.items()}

    # ------------------------------------------------------------------ sizes
    @property
    def body_size(self) -> int:
        return self.body_keys.shape[0]

    @property
    def tail_keys(self) -> torch.Tensor:
        return self._tail_k[:, :, : self.tail_size]

    @property
    def tail_values(self) -> torch.Tensor:
        return self._tail_v[:, :, : self.tail_size]

    @property
    def tail_positions(self) -> torch.Tensor:
        return self._tail_pos[: self.tail_size]

    @property
    def tail_modality(self) -> torch.Tensor:
        return self._tail_mod[:, : self.tail_size]

    @property
    def tail_valid(self) -> torch.Tensor:
        return self._tail_valid[:, : self.tail_size]

    @property
    def tail_state(self) -> dict[str, torch.Tensor]:
        return {n: t[..., : self.tail_size] for n, t in self._tail_state.items()}

    @property
    def tail_capacity(self) -> int:
        return self._tail_k.shape[2]

    @property
    def bytes_per_entry(self) -> int:
        return 2 * self.head_dim * self.body_keys.element_size()

    def num_entries(self) -> int:
        return self.body_size + self.batch_size * self.num_kv_heads * self.tail_size

    def kv_bytes(self) -> int:
        """Bytes allocated for keys and values: the body and the whole tail buffer."""
        return tensor_bytes(self.body_keys, self.body_values, self._tail_k, self._tail_v)

    def slot_bytes(self) -> int:
        """Bytes one more token of tail capacity allocates: its keys and values in every row, and
        its position, modality, validity and policy state."""
        rows = self.batch_size * self.num_kv_heads
        meta = 4 + 2 * self.batch_size + 4 * rows * len(self.state_names)
        return rows * self.bytes_per_entry + meta

    def unused_bytes(self) -> int:
        """Allocated key/value bytes that hold no entry yet (the tail buffer's spare capacity)."""
        spare = self.tail_capacity - self.tail_size
        return spare * self.batch_size * self.num_kv_heads * self.bytes_per_entry

    def meta_bytes(self) -> int:
        """Bytes of positions, modality, policy state and row bookkeeping."""
        return tensor_bytes(
            self.body_positions, self.body_modality, self.lengths, self.row_starts, self._rows, self._cols,
            self.entry_head, *(self._body_table or ()), self._tail_pos, self._tail_mod, self._tail_valid,
            *self.body_state.values(), *self._tail_state.values(),
        )

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
        positions: "torch.Tensor | int",
        modality: torch.Tensor,
        valid: torch.Tensor,
        all_valid: bool | None = None,
    ) -> None:
        """Add new tokens to the tail, in place. keys/values: [B, H, Q, D]; positions: [Q], or the
        first position as an int (the tokens then follow each other); modality/valid: [B, Q]."""
        q = keys.shape[2]
        T = self.tail_size
        self._grow_tail(T + q, reserve=q == 1)
        self._tail_k[:, :, T : T + q].copy_(keys)
        self._tail_v[:, :, T : T + q].copy_(values)
        if isinstance(positions, int):
            if q == 1:
                self._tail_pos[T] = positions
            else:
                torch.arange(positions, positions + q, out=self._tail_pos[T : T + q])
        else:
            self._tail_pos[T : T + q].copy_(positions)
        self._tail_mod[:, T : T + q].copy_(modality)
        self._tail_valid[:, T : T + q].copy_(valid)
        for t in self._tail_state.values():
            t[..., T : T + q].zero_()
        self.tail_size = T + q
        if self.tail_all_valid and q:
            self.tail_all_valid = bool(valid.all()) if all_valid is None else all_valid

    def drop_newest(self, count: int) -> None:
        """Forget the ``count`` newest tail tokens (a forward that raised half-way)."""
        if count > self.tail_size:
            raise ValueError(f"cannot drop {count} tokens from a tail of {self.tail_size}")
        self.tail_size -= count
        self.tail_all_valid = bool(self.tail_valid.all()) if self.tail_size else True

    def set_tail_state(self, name: str, values: torch.Tensor) -> None:
        """Overwrite the state of the newest ``values.shape[-1]`` tail entries ([B, H, Q])."""
        q = values.shape[-1]
        with torch.no_grad():  # policy state is bookkeeping, never differentiated (see add_state_split)
            self._tail_state[name][..., self.tail_size - q : self.tail_size].copy_(values)

    def split_padded(self, padded: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """A per-entry [B, H, L] quantity laid out like ``padded_view``, split as the store lays
        entries out: (body [N] or None, tail [B, H, T])."""
        rows = self.batch_size * self.num_kv_heads
        flat = padded.reshape(rows, -1)
        body = flat[self._rows, self._cols] if self.body_size else None
        cols = self.lengths[:, None] + torch.arange(self.tail_size, device=self.device)[None]
        return body, flat.gather(1, cols).view(self.batch_size, self.num_kv_heads, -1)

    def add_state(self, name: str, padded: torch.Tensor) -> None:
        """Add a padded [B, H, L] quantity (laid out like ``padded_view``) to the entries' state."""
        self.add_state_split(name, *self.split_padded(padded))

    def add_state_split(self, name: str, body: torch.Tensor | None, tail: torch.Tensor | None) -> None:
        """Add a quantity given where the entries lie: ``body`` [N] in body order, ``tail`` [B, H, T]."""
        # policy state is bookkeeping, never differentiated: a forward run in grad mode (a user's
        # ``model(...)`` outside ``torch.no_grad``) must not try to record in-place adds to buffers
        # an eviction step rebuilt under no_grad (that raised for h2o-like scorers in a chunked prefill)
        with torch.no_grad():
            if body is not None and self.body_size:
                self.body_state[name] += body
            if tail is not None and self.tail_size:
                self._tail_state[name][..., : self.tail_size] += tail

    # ------------------------------------------------------------------ views
    def body_dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Body keys and values as [B, H, L, D] views; only when every head holds the same length."""
        B, H, D = self.batch_size, self.num_kv_heads, self.head_dim
        L = self.max_length
        return self.body_keys.view(B, H, L, D), self.body_values.view(B, H, L, D)

    def batch_span(self, b: int) -> tuple[int, int]:
        """(start, count) of batch row ``b``'s entries in the flat body."""
        return self._batch_spans[b]

    def entry_source(self) -> EntrySource:
        """The entries' keys and values as they lie now, addressed like ``padded_view``."""
        return EntrySource(self.body_keys, self.body_values, self.row_starts, self.lengths,
                           self.tail_keys, self.tail_values)

    def padded_view(
        self, with_values: bool = True, states: tuple[str, ...] = (), with_modality: bool = True,
        with_keys: bool = True,
    ) -> PaddedView:
        """Body then tail per (batch, head) row, left aligned, padded to the longest row.

        Attention needs only keys, values, positions and validity; scoring and compaction
        ask for modality and policy state too. ``with_keys=False`` (needs ``with_values=False``):
        keys [B, H, L, 0], for scoring by state and positions (``entry_source`` reads the few
        entries a routing event moves).
        """
        if not with_keys and with_values:
            raise ValueError("a padded view without keys carries no values either (with_values=False)")
        B, H, T = self.batch_size, self.num_kv_heads, self.tail_size
        dev = self.device
        tail_valid = self.tail_valid[:, None, :].expand(B, H, T)
        tail_pos = self.tail_positions.long()[None, None, :].expand(B, H, T)
        tail_mod = self.tail_modality[:, None, :].expand(B, H, T)
        tail_state = self.tail_state
        if self.body_size == 0:
            return PaddedView(
                keys=self.tail_keys if with_keys else self.tail_keys[..., :0],
                values=self.tail_values if with_values else self.tail_values[..., :0],
                positions=tail_pos,
                modality=tail_mod,
                valid=tail_valid,
                state={n: tail_state[n] for n in states},
            )
        rows = B * H
        longest = self.max_length + T
        if self.uniform:  # every row holds the same length: body then tail side by side, no scatter
            L = self.max_length

            def side(body: torch.Tensor, tail: torch.Tensor, dtype) -> torch.Tensor:
                body = body.to(dtype).view((B, H, L) + tuple(body.shape[1:]))
                return torch.cat([body, tail.to(dtype)], dim=2) if T else body

            keys = (side(self.body_keys, self.tail_keys, self.dtype) if with_keys
                    else torch.empty(B, H, L + T, 0, dtype=self.dtype, device=dev))
            values = side(self.body_values, self.tail_values, self.dtype) if with_values else keys[..., :0]
            valid = torch.cat([torch.ones(B, H, L, dtype=torch.bool, device=dev), tail_valid], dim=2)
            positions = side(self.body_positions, tail_pos, torch.long)
            modality = side(self.body_modality, tail_mod, torch.uint8) if with_modality else valid[..., :0]
            state = {n: side(self.body_state[n], tail_state[n], torch.float32) for n in states}
            return PaddedView(keys, values, positions, modality, valid, state)
        tail_cols = self.lengths[:, None] + torch.arange(T, device=dev)[None]
        row_ids = torch.arange(rows, device=dev)[:, None].expand(rows, T)

        def lay(body: torch.Tensor, tail: torch.Tensor, fill, dtype) -> torch.Tensor:
            shape = (rows, longest) + tuple(body.shape[1:])
            out = torch.full(shape, fill, dtype=dtype, device=dev) if fill != 0 else torch.zeros(shape, dtype=dtype, device=dev)
            out[self._rows, self._cols] = body.to(dtype)
            if T:
                out[row_ids, tail_cols] = tail.reshape((rows, T) + tuple(body.shape[1:])).to(dtype)
            return out.view((B, H, longest) + tuple(body.shape[1:]))

        keys = (lay(self.body_keys, self.tail_keys, 0, self.dtype) if with_keys
                else torch.empty(B, H, longest, 0, dtype=self.dtype, device=dev))
        values = lay(self.body_values, self.tail_values, 0, self.dtype) if with_values else keys[..., :0]
        ones = torch.ones(self.body_size, dtype=torch.bool, device=dev)
        valid = lay(ones, tail_valid, 0, torch.bool)
        positions = lay(self.body_positions.long(), tail_pos, -1, torch.long)
        modality = lay(self.body_modality, tail_mod, 0, torch.uint8) if with_modality else valid[..., :0]
        state = {n: lay(self.body_state[n], tail_state[n], 0, torch.float32) for n in states}
        return PaddedView(keys, values, positions, modality, valid, state)

    # -------------------------------------------------------------- eviction
    def compact(self, keep: torch.Tensor, view: PaddedView | None = None, insert: "Entries | None" = None) -> None:
        """Keep the entries marked in ``keep`` ([B, H, L], laid out like ``padded_view``) and free the rest.

        Reads the kept entries from where they lie (body and tail), so no padded copy of the
        values is needed; ``view`` is accepted for callers that have one but is not required.
        ``insert`` adds entries (promoted from the INT2 tier) to the new body, each at its place
        by position within its row.
        """
        B, H, T = self.batch_size, self.num_kv_heads, self.tail_size
        rows = B * H
        L = keep.shape[-1]
        keep = keep.reshape(rows, L)
        if insert is None and self.uniform and self.tail_all_valid and self._compact_rows_alike(keep):
            return
        body_keep = keep[self._rows, self._cols] if self.body_size else keep.new_zeros(0)
        if T:
            tail_cols = self.lengths[:, None] + torch.arange(T, device=self.device)[None]
            tail_keep = keep.gather(1, tail_cols) & self.tail_valid.repeat_interleave(H, dim=0)
        else:
            tail_keep = keep.new_zeros(rows, 0)
        new_lengths = torch.zeros(rows, dtype=torch.long, device=self.device)
        if self.body_size:
            new_lengths.index_add_(0, self._rows, body_keep.long())
        new_lengths += tail_keep.sum(dim=1)
        body_idx = torch.nonzero(body_keep).flatten()
        tail_r, tail_t = torch.nonzero(tail_keep, as_tuple=True)
        batch_of = tail_r // H
        tk = self.tail_keys.reshape(rows, T, self.head_dim)
        tv = self.tail_values.reshape(rows, T, self.head_dim)
        tail_state = self.tail_state
        parts = {
            "rows": [self._rows[body_idx], tail_r],
            "keys": [self.body_keys[body_idx], tk[tail_r, tail_t]],
            "values": [self.body_values[body_idx], tv[tail_r, tail_t]],
            "positions": [self.body_positions[body_idx], self.tail_positions[tail_t]],
            "modality": [self.body_modality[body_idx], self.tail_modality[batch_of, tail_t]],
        }
        states = {n: [self.body_state[n][body_idx], tail_state[n].reshape(rows, T)[tail_r, tail_t]] for n in self.state_names}
        if insert is not None and insert.rows.numel():
            new_lengths.index_add_(0, insert.rows, torch.ones_like(insert.rows))
            for name in parts:
                parts[name].append(getattr(insert, name).to(parts[name][0].dtype))
            for n in self.state_names:
                states[n].append(insert.state[n].float())
        src_row = torch.cat(parts["rows"])
        src_pos = torch.cat(parts["positions"]).long()
        # New body order: by row, then by original position (body before tail, promoted entries in between).
        order = torch.argsort(src_row * (int(src_pos.max()) + 2 if src_pos.numel() else 1) + src_pos)

        def merge(chunks: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat(chunks)[order].contiguous()

        self.body_keys = merge(parts["keys"])
        self.body_values = merge(parts["values"])
        self.body_positions = merge(parts["positions"])
        self.body_modality = merge(parts["modality"])
        self.body_state = {n: merge(states[n]) for n in self.state_names}
        self._set_layout(new_lengths)
        self._release_tail()

    def _compact_rows_alike(self, keep: torch.Tensor) -> bool:
        """``compact`` when every row holds the same length (no padding) and keeps the same count:
        each row's body then tail is already in position order, so the kept entries are a gather
        of the same number of columns per row (no sort). Returns False, doing nothing, otherwise."""
        rows, width = keep.shape
        counts = keep.sum(dim=1)
        n = int(counts[0]) if rows else 0
        if rows == 0 or bool((counts != n).any()):
            return False
        B, H, T, L = self.batch_size, self.num_kv_heads, self.tail_size, self.max_length
        cols = keep.nonzero()[:, 1].view(rows, n)  # ascending within each row

        def pick(body: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
            extra = tuple(body.shape[1:])
            whole = torch.cat([body.view((rows, L) + extra), tail.reshape((rows, T) + extra).to(body.dtype)], dim=1)
            index = cols.view((rows, n) + (1,) * len(extra)).expand((rows, n) + extra)
            return whole.gather(1, index).reshape((rows * n,) + extra)

        tail_state = self.tail_state
        self.body_keys = pick(self.body_keys, self.tail_keys)
        self.body_values = pick(self.body_values, self.tail_values)
        self.body_positions = pick(self.body_positions, self.tail_positions[None, :].expand(rows, T))
        self.body_modality = pick(self.body_modality, self.tail_modality[:, None, :].expand(B, H, T))
        self.body_state = {name: pick(self.body_state[name], tail_state[name]) for name in self.state_names}
        self._set_layout(torch.full((rows,), n, dtype=torch.long, device=self.device))
        self._release_tail()
        return True

    def repeat_batch(self, repeats: int) -> None:
        """Repeat every sequence's entries ``repeats`` times (row b -> rows b*repeats .. b*repeats+repeats-1)."""
        B, H, T = self.batch_size, self.num_kv_heads, self.tail_size
        order = torch.arange(B * H, device=self.device).view(B, 1, H).expand(B, repeats, H).reshape(-1)
        starts, lens = self.row_starts[order], self.lengths[order]
        idx = torch.repeat_interleave(starts - (torch.cumsum(lens, 0) - lens), lens) + torch.arange(int(lens.sum()), device=self.device)
        self.body_keys = self.body_keys[idx]
        self.body_values = self.body_values[idx]
        self.body_positions = self.body_positions[idx]
        self.body_modality = self.body_modality[idx]
        self.body_state = {n: t[idx] for n, t in self.body_state.items()}
        self.batch_size = B * repeats
        self._set_layout(lens.clone())
        self._tail_k = self._tail_k.repeat_interleave(repeats, dim=0)
        self._tail_v = self._tail_v.repeat_interleave(repeats, dim=0)
        self._tail_mod = self._tail_mod.repeat_interleave(repeats, dim=0)
        self._tail_valid = self._tail_valid.repeat_interleave(repeats, dim=0)
        self._tail_state = {n: t.repeat_interleave(repeats, dim=0) for n, t in self._tail_state.items()}
        self.tail_size = T
