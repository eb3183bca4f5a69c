"""The INT2 tier of one layer and its write-once quantization ledger (QEvict).

A *window* is ``w`` consecutive positions of one (batch, kv head) row: window id
``(position - origin) // w``, counted from the sequence's first real token (``windows``). A window is quantized once, at its first demotion from full precision
(KIVI's grid: keys per channel over the window, values per token), and its codes go into the
ledger. While the window lives in the INT2 tier its ledger entry is *active*: attention reads
it (dequantized) in the same softmax as the FP entries, and scorers keep accruing state on it.
A promotion dequantizes the codes back into the FP store and leaves the entry *dormant*; a later
demotion reuses the stored codes instead of quantizing the (already lossy) FP copy again, so
error never compounds. Evicting a window drops its entry.

Optional *spill tier* (``spill=True``, off by default): every ledger entry also keeps the window's
original full-precision keys (as cached, post-RoPE) and values in host memory (CPU tensors,
pinned when the cache lives on CUDA and pinning works), so a promotion restores the exact
original entries instead of the dequantized codes. The host copies live and die with their
ledger entry (dormant entries keep theirs, evicted windows drop theirs). They are host memory,
not device memory: the byte budget does not count them; ``kv_bytes()["per_tier"]["spill"]``
reports them.

Only complete windows (every position already seen) are ever quantized, so no new token can
join a window that lives in INT2; the router guarantees it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from vlm_kv.attention.backend import PackedWindows
from vlm_kv.attention.decode import RotatedEntries
from vlm_kv.config import TierConfig
from vlm_kv.kernels.int2 import (
    decode_key_grid,
    dequantize_keys,
    dequantize_values,
    int2_basis,
    int2_window_bytes,
    quantize_keys,
    quantize_keys_compact,
    quantize_values,
    unpack_int2_float,
)
from vlm_kv.storage.store import PaddedView, tensor_bytes
from vlm_kv.tiers.rope_keys import KeyRotation


@dataclass
class QuantizedWindows:
    """Codes and grids of ``n`` windows, exactly sized (see ``vlm_kv.kernels.int2`` for the layout).

    The keys' grid is fp16 scale and zero per channel (the paper's), or with the compact grid
    (``key_grid="int8"``) their 8-bit codes plus three fp16 references per window in ``key_ref``
    (empty [n, 0] for fp16 grids); ``key_grid()`` gives both as scale and zero."""

    key_codes: torch.Tensor    # [n, w, D // 4] uint8
    key_scale: torch.Tensor    # [n, D] float16, or uint8 scale codes (compact)
    key_zero: torch.Tensor     # [n, D] float16, or uint8 zero codes (compact)
    value_codes: torch.Tensor  # [n, w, D // 4] uint8
    value_scale: torch.Tensor  # [n, w] float16
    value_zero: torch.Tensor   # [n, w] float16
    key_ref: torch.Tensor      # [n, 3] float16 (z_lo, z_step, s_step) for compact grids, [n, 0] for fp16

    @classmethod
    def empty(cls, window: int, head_dim: int, device: torch.device, key_grid: str) -> "QuantizedWindows":
        u8, f16 = torch.uint8, torch.float16
        grid = f16 if key_grid == "fp16" else u8
        return cls(
            torch.empty(0, window, head_dim // 4, dtype=u8, device=device),
            torch.empty(0, head_dim, dtype=grid, device=device),
            torch.empty(0, head_dim, dtype=grid, device=device),
            torch.empty(0, window, head_dim // 4, dtype=u8, device=device),
            torch.empty(0, window, dtype=f16, device=device),
            torch.empty(0, window, dtype=f16, device=device),
            torch.empty(0, 0 if key_grid == "fp16" else 3, dtype=f16, device=device),
        )

    @classmethod
    def quantize(cls, keys: torch.Tensor, values: torch.Tensor, key_grid: str) -> "QuantizedWindows":
        """keys/values [n, w, D] -> their codes and grids (``key_grid`` as ``TierConfig`` checked it)."""
        vc, vs, vz = quantize_values(values)
        if key_grid == "fp16":
            kc, ks, kz = quantize_keys(keys)
            ref = torch.empty(keys.shape[0], 0, dtype=torch.float16, device=keys.device)
        else:
            kc, kz, ks, ref = quantize_keys_compact(keys)
        return cls(kc, ks, kz, vc, vs, vz, ref)

    def __len__(self) -> int:
        return self.key_codes.shape[0]

    @property
    def compact(self) -> bool:
        return self.key_scale.dtype == torch.uint8

    def key_grid(self, idx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys' (scale, zero) [n, D] of every window (or of windows ``idx``): the stored fp16
        grid, or the compact grid decoded to float32 (a transient the size of one fp32 grid)."""
        ks, kz, ref = self.key_scale, self.key_zero, self.key_ref
        if idx is not None:
            ks, kz, ref = ks[idx], kz[idx], ref[idx]
        if not self.compact:
            return ks, kz
        return decode_key_grid(kz, ks, ref)

    def _tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]

    def select(self, idx: torch.Tensor) -> "QuantizedWindows":
        return QuantizedWindows(*(t.index_select(0, idx) for t in self._tensors()))

    @staticmethod
    def cat(parts: list["QuantizedWindows"]) -> "QuantizedWindows":
        return QuantizedWindows(*(torch.cat(ts) for ts in zip(*(p._tensors() for p in parts))))

    def split(self, sizes: list[int]) -> list["QuantizedWindows"]:
        """Consecutive runs of ``sizes`` windows (views, in order): the inverse of ``cat``."""
        return [QuantizedWindows(*ts) for ts in zip(*(t.split(sizes) for t in self._tensors()))]

    def dequantize(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, w, D] keys and values in ``dtype``."""
        keys = dequantize_keys(self.key_codes, *self.key_grid()).to(dtype)
        values = dequantize_values(self.value_codes, self.value_scale, self.value_zero).to(dtype)
        return keys, values

    def code_bytes(self) -> int:
        return self.key_codes.nbytes + self.value_codes.nbytes

    def grid_bytes(self) -> int:
        return sum(t.nbytes for t in (self.key_scale, self.key_zero, self.key_ref, self.value_scale, self.value_zero))


@dataclass
class SpillCopies:
    """Original full-precision keys and values of ``n`` windows in host memory ([n, w, D] each,
    model dtype), in ledger order. Rebuilt exactly sized, so dropped windows free their bytes."""

    keys: torch.Tensor
    values: torch.Tensor

    @staticmethod
    def pin_for(device: torch.device) -> bool:
        """Pin host copies when the cache is on CUDA (faster, asynchronous-capable host-to-device copies)."""
        return device.type == "cuda" and torch.cuda.is_available()

    @classmethod
    def empty(cls, window: int, head_dim: int, dtype: torch.dtype) -> "SpillCopies":
        return cls(torch.empty(0, window, head_dim, dtype=dtype), torch.empty(0, window, head_dim, dtype=dtype))

    @classmethod
    def from_device(cls, keys: torch.Tensor, values: torch.Tensor, pin: bool) -> "SpillCopies":
        return cls(_to_host(keys, pin), _to_host(values, pin))

    def __len__(self) -> int:
        return self.keys.shape[0]

    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def select(self, idx: torch.Tensor, pin: bool) -> "SpillCopies":
        idx = idx.cpu()
        return SpillCopies(_host_select(self.keys, idx, pin), _host_select(self.values, idx, pin))

    @staticmethod
    def cat(parts: list["SpillCopies"], pin: bool) -> "SpillCopies":
        return SpillCopies(_host_cat([p.keys for p in parts], pin), _host_cat([p.values for p in parts], pin))

    def restore(self, idx: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """[len(idx), w, D] original keys and values of windows ``idx``, on ``device``."""
        idx = idx.cpu()
        return self.keys.index_select(0, idx).to(device), self.values.index_select(0, idx).to(device)


def _pinned_empty(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    if pin:
        try:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        except RuntimeError:  # no pinnable memory (driver, container limits): pageable host memory still works
            pass
    return torch.empty(shape, dtype=dtype)


def _to_host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    out = _pinned_empty(tuple(t.shape), t.dtype, pin)
    out.copy_(t)  # blocking: the source may be overwritten by the next store rebuild
    return out


def _host_select(t: torch.Tensor, idx: torch.Tensor, pin: bool) -> torch.Tensor:
    out = _pinned_empty((idx.numel(),) + tuple(t.shape[1:]), t.dtype, pin)
    return torch.index_select(t, 0, idx, out=out)


def _host_cat(ts: list[torch.Tensor], pin: bool) -> torch.Tensor:
    out = _pinned_empty((sum(t.shape[0] for t in ts),) + tuple(ts[0].shape[1:]), ts[0].dtype, pin)
    return torch.cat(ts, out=out)


@dataclass
class TierCounters:
    """What moved between tiers since the cache was built."""

    quantized: int = 0        # windows quantized (first demotions: each window at most once per life)
    ledger_reuses: int = 0    # demotions that reused a dormant ledger entry's codes
    demotions: int = 0        # FP -> INT2, windows
    promotions: int = 0       # INT2 -> FP, windows
    evicted_windows: int = 0  # INT2 windows evicted

    def add(self, other: "TierCounters") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass(frozen=True)
class TierShape:
    """The shape of one layer's tier: its rows (batch x kv heads), head size, model dtype and device."""

    batch_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True)
class SlotPlacement:
    """Where the slots of the active windows go in the per-row view: window ``idx[i]``'s slot ``s``
    lands at flat place ``dest[i * w + s]`` of [B, H, length]."""

    idx: torch.Tensor   # [n] ledger index of each active window, by row then window id
    dest: torch.Tensor  # [n * w] flat destination in [B * H * length]
    length: int         # Lq: slots per row (the most windows any row has, times w)
    batch_size: int
    num_kv_heads: int

    def lay(self, src: torch.Tensor, fill: float | bool, dtype: torch.dtype) -> torch.Tensor:
        """[n, w, ...] per-window slots -> [B, H, length, ...] per row, left aligned."""
        B, H, L = self.batch_size, self.num_kv_heads, self.length
        tail = tuple(src.shape[2:])
        out = torch.full((B * H * L,) + tail, fill, dtype=dtype, device=self.dest.device)
        out[self.dest] = src.reshape((-1,) + tail).to(dtype)
        return out.view((B, H, L) + tail)


@dataclass(frozen=True)
class TierLayout:
    """The active windows laid out per row (fixed between routing events): the view's metadata,
    the kernels' window table and the attended-slot mask."""

    placement: SlotPlacement
    valid: torch.Tensor                    # [B, H, Lq] slots holding an attended entry
    positions: torch.Tensor                # [B, H, Lq] long, -1 where empty
    modality: torch.Tensor                 # [B, H, Lq] uint8
    slot: torch.Tensor                     # [B, H, Lq] ledger index * w + slot, -1 where empty
    table: tuple[torch.Tensor, torch.Tensor]  # ([rows, max_windows] int32 ledger index, [rows] int32 counts)
    full: bool                             # every active window holds w attended entries
    slot_mask: torch.Tensor | None         # [n, w] attended slots of every ledger window, None when full
    windows_per_sequence: tuple[int, ...] = ()  # active windows of each sequence (idx is in that order)
    windows_per_head: tuple[tuple[int, ...], ...] = ()  # per sequence, active windows of each KV head
    prefix: bool = False                   # idx is 0..n-1: the active windows lead the ledger, in this order

    @property
    def idx(self) -> torch.Tensor:
        return self.placement.idx


@dataclass
class RefreshedSlots:
    """New metadata for kept ledger entries at a rebuild: rows ``index`` of the kept order get
    these positions, modality and state (entries demoted back into their stored codes)."""

    index: torch.Tensor
    positions: torch.Tensor
    modality: torch.Tensor
    state: dict[str, torch.Tensor]


@dataclass
class TierView:
    """The active windows of a layer laid out per row like ``PaddedView`` ([B, H, Lq]),
    with ``slot`` [B, H, Lq] = ledger index * w + slot in the window (-1 where empty)."""

    view: PaddedView
    slot: torch.Tensor


class Int2Tier:
    """Quantized windows of one layer: the INT2 tier (active entries) and the dormant ledger."""

    def __init__(self, shape: TierShape, config: TierConfig, state_names: tuple[str, ...] = (),
                 rope: KeyRotation | None = None) -> None:
        """An empty tier of ``shape`` with ``config``'s window, spill, key grid and basis (TierConfig
        holds their defaults and checks them)."""
        head_dim, window, device = shape.head_dim, config.window, shape.device
        if head_dim % 4:
            raise ValueError(f"INT2 packs four channels per byte: head_dim {head_dim} must be a multiple of 4")
        self.batch_size = shape.batch_size
        self.num_kv_heads = shape.num_kv_heads
        self.head_dim = head_dim
        self.window = window
        self.dtype = shape.dtype
        self.device = device
        self.state_names = tuple(state_names)
        self.rope = rope  # a KeyRotation when keys are quantized pre-RoPE, else None
        self.key_grid = config.key_grid
        # [D, D] orthonormal matrices keys and values are quantized in (Hadamard), None for the channel basis
        self.key_basis, self.value_basis = int2_basis(config.basis, head_dim, device)
        self.codes = QuantizedWindows.empty(window, head_dim, device, self.key_grid)
        self.row = torch.empty(0, dtype=torch.long, device=device)        # b * H + h
        self.window_id = torch.empty(0, dtype=torch.long, device=device)  # (position - origin) // w
        self.positions = torch.empty(0, window, dtype=torch.int32, device=device)  # -1: no entry in that slot
        self.modality = torch.empty(0, window, dtype=torch.uint8, device=device)
        self.state = {n: torch.empty(0, window, dtype=torch.float32, device=device) for n in self.state_names}
        self.active = torch.empty(0, dtype=torch.bool, device=device)
        self._num_active = 0  # read on every decode step: kept as an int, no device sync
        self._layout_cache: TierLayout | None = None
        # packed_windows' views of the codes, fixed between routing events like the layout (dropped
        # with it, so that no view keeps replaced codes alive)
        self._packed_cache: list[PackedWindows] | None = None
        self.counters = TierCounters()
        # host copies of the original FP windows, aligned with the ledger (spill tier), or None
        self.pin_spill = SpillCopies.pin_for(device)
        self.spill = SpillCopies.empty(window, head_dim, shape.dtype) if config.spill else None

    @classmethod
    def for_keys(cls, key_states: torch.Tensor, config: TierConfig, state_names: tuple[str, ...] = (),
                 rope: KeyRotation | None = None) -> "Int2Tier":
        """An empty tier for one layer whose first keys are ``key_states`` [B, H, L, D]."""
        b, h, _, d = key_states.shape
        return cls(TierShape(b, h, d, key_states.dtype, key_states.device), config, state_names, rope=rope)

    # ------------------------------------------------------------------ sizes
    def __len__(self) -> int:
        return len(self.codes)

    @property
    def num_active(self) -> int:
        return self._num_active

    def num_entries(self) -> int:
        """Entries attended from this tier (valid slots of active windows)."""
        return int((self.positions[self.active] >= 0).sum()) if len(self) else 0

    def window_bytes(self) -> int:
        """Bytes one window of one row holds (codes, scales and zeros)."""
        return int2_window_bytes(self.window, self.head_dim, self.key_grid)

    def tier_bytes(self) -> dict[str, int]:
        """Bytes by part: ``int2`` codes and ``scales`` (scales and zeros) of active windows,
        ``ledger`` = codes and grids kept for dormant windows. The tensors are exactly sized, so
        these add up to their storage."""
        n, active = len(self), self.num_active
        if n == 0:
            return {"int2": 0, "scales": 0, "ledger": 0}
        code, grid = self.codes.code_bytes() // n, self.codes.grid_bytes() // n
        return {"int2": active * code, "scales": active * grid, "ledger": (n - active) * (code + grid)}

    def spill_bytes(self) -> int:
        """Host bytes of the spill tier's original FP copies (0 without spill). Not device memory:
        not in ``tier_bytes`` and not counted against the byte budget."""
        return self.spill.nbytes() if self.spill is not None else 0

    def meta_bytes(self) -> int:
        return tensor_bytes(self.row, self.window_id, self.positions, self.modality, self.active, *self.state.values())

    def modality_counts(self, num_modalities: int) -> torch.Tensor:
        mods = self.modality[self.active][self.positions[self.active] >= 0]
        return torch.bincount(mods.long(), minlength=num_modalities)[:num_modalities]

    def entries_per_row(self) -> torch.Tensor:
        """[rows] entries held in the INT2 tier per (batch, kv head)."""
        rows = self.batch_size * self.num_kv_heads
        counts = (self.positions >= 0).sum(dim=1) * self.active
        return torch.zeros(rows, dtype=torch.long, device=self.device).index_add_(0, self.row, counts.long())

    # ------------------------------------------------------------------ views
    def _layout(self) -> TierLayout:
        """Where each active window's slots go in ``view`` (fixed between routing events)."""
        if self._layout_cache is not None:
            return self._layout_cache
        B, H, w = self.batch_size, self.num_kv_heads, self.window
        rows = B * H
        idx = torch.nonzero(self.active).flatten()
        if idx.numel():
            order = torch.argsort(self.row[idx] * (int(self.window_id.max()) + 1) + self.window_id[idx])
            idx = idx[order]
        row = self.row[idx]
        counts = torch.bincount(row, minlength=rows)
        most = int(counts.max()) if idx.numel() else 0
        rank = torch.arange(idx.numel(), device=self.device) - (torch.cumsum(counts, 0) - counts)[row]
        L = most * w
        dest = ((row * L + rank * w)[:, None] + torch.arange(w, device=self.device)[None]).reshape(-1)
        place = SlotPlacement(idx, dest, L, B, H)
        pos = self.positions[idx]
        valid = place.lay(pos >= 0, False, torch.bool)
        slot_ids = idx[:, None] * w + torch.arange(w, device=self.device)[None]
        table = torch.zeros(rows, max(most, 1), dtype=torch.int32, device=self.device)
        table[row, rank] = idx.to(torch.int32)
        full = bool((pos >= 0).all())
        self._layout_cache = TierLayout(
            placement=place,
            valid=valid,
            positions=place.lay(pos.long(), -1, torch.long),
            modality=place.lay(self.modality[idx], 0, torch.uint8),
            slot=place.lay(slot_ids, -1, torch.long).masked_fill(~valid, -1),
            table=(table, counts.to(torch.int32)),
            full=full,
            # attended slots of every ledger window, for the kernels when a window has a hole or an empty slot
            slot_mask=None if full else (self.positions >= 0).contiguous(),
            windows_per_sequence=tuple(counts.view(B, H).sum(dim=1).tolist()),
            windows_per_head=tuple(tuple(r) for r in counts.view(B, H).tolist()),
            prefix=idx.numel() == 0 or (int(idx[0]) == 0 and int(idx[-1]) == idx.numel() - 1),
        )
        return self._layout_cache

    def _forget_layout(self) -> None:
        self._layout_cache = None
        self._packed_cache = None

    def window_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Active windows per row for the kernels: ([rows, max_windows] int32 ledger index, [rows] int32 counts)."""
        return self._layout().table

    @property
    def windows_full(self) -> bool:
        """Every active window holds w attended entries (no holes, no empty slots)."""
        return self._layout().full

    @property
    def kernel_readable(self) -> bool:
        """The Triton kernels can read these windows as stored: the codes are post-RoPE keys (pre-RoPE
        codes need the PyTorch path, which rotates them). Holes and empty slots (batch padding, a
        fallback step, entries routed to FP) go to the kernels as a slot mask."""
        return self.rope is None

    def quantize(self, keys: torch.Tensor, values: torch.Tensor) -> QuantizedWindows:
        """Codes of windows [n, w, D] (keys already pre-RoPE when ``rope`` is set), in the tier's basis."""
        return QuantizedWindows.quantize(_into(keys, self.key_basis), _into(values, self.value_basis), self.key_grid)

    def quantizes_like(self, other: "Int2Tier") -> bool:
        """``quantize`` gives both tiers the same codes for the same windows (same window, head size,
        key grid and bases): their windows may be quantized in one call."""
        return (self.window == other.window and self.head_dim == other.head_dim and self.key_grid == other.key_grid
                and _same_basis(self.key_basis, other.key_basis) and _same_basis(self.value_basis, other.value_basis))

    def dequantize(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (post-RoPE, as attended) and values [len(idx), w, D] of ledger windows ``idx``, model dtype."""
        c = self.codes
        keys = self._decode_keys(c.key_codes[idx], *c.key_grid(idx), self.positions[idx])
        values = _out_of(dequantize_values(c.value_codes[idx], c.value_scale[idx], c.value_zero[idx]), self.value_basis)
        return keys.to(self.dtype), values.to(self.dtype)

    @property
    def rotated(self) -> bool:
        return self.key_basis is not None or self.value_basis is not None

    def _decode_keys(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
        keys = _out_of(dequantize_keys(codes, scale, zero), self.key_basis)
        return keys if self.rope is None else self.rope.rotate(keys, positions)

    def kernel_pools(self) -> tuple[torch.Tensor, ...]:
        """The INT2 tuple the Triton kernels read: codes, scales, zeros, window table and counts,
        then the attended-slot mask when a window has a hole. A compact key grid reaches the kernels
        decoded (float32 scale and zero, rebuilt per call so that the cache holds only the codes).
        With a Hadamard basis the codes are of rotated keys (``key_basis``) and values (``value_basis``):
        the kernel must attend them with the query times ``key_basis`` and multiply their output by
        ``value_basis.T``."""
        c = self.codes
        pools = (c.key_codes, *c.key_grid(), c.value_codes, c.value_scale, c.value_zero, *self.window_table())
        mask = self._layout().slot_mask
        return pools if mask is None else pools + (mask,)

    def view(self, states: tuple[str, ...] = (), with_values: bool = True, dtype: torch.dtype | None = None,
             in_basis: bool = False, with_keys: bool = True) -> TierView:
        """Active windows dequantized, per row in window order, left aligned ([B, H, Lq]).
        ``in_basis``: keys and values left in the basis they were quantized in (post-RoPE keys only),
        for attention that rotates the query instead (``vlm_kv.attention.reference.rotated_tier_attention``).
        ``with_keys=False`` (needs ``with_values=False``): keys [B, H, Lq, 0], nothing dequantized,
        for scoring by state and positions."""
        if not with_keys and with_values:
            raise ValueError("a tier view without keys carries no values either (with_values=False)")
        if in_basis and self.rope is not None:
            raise ValueError("in_basis=True needs post-RoPE codes: pre-RoPE keys must be rotated back per position")
        dtype = dtype or self.dtype
        layout = self._layout()
        place, idx = layout.placement, layout.idx
        c = self.codes
        if not with_keys:
            B, H = self.batch_size, self.num_kv_heads
            keys = torch.empty(B, H, place.length, 0, dtype=dtype, device=self.device)
        elif in_basis:
            keys = place.lay(dequantize_keys(c.key_codes[idx], *c.key_grid(idx)), 0, dtype)
        else:
            keys = place.lay(self._decode_keys(c.key_codes[idx], *c.key_grid(idx), self.positions[idx]), 0, dtype)
        if with_values:
            values = dequantize_values(c.value_codes[idx], c.value_scale[idx], c.value_zero[idx])
            values = place.lay(values if in_basis else _out_of(values, self.value_basis), 0, dtype)
        else:
            values = keys[..., :0]
        view = PaddedView(
            keys=keys, values=values, positions=layout.positions, modality=layout.modality, valid=layout.valid,
            state={n: place.lay(self.state[n][idx], 0.0, torch.float32) for n in states},
        )
        return TierView(view, layout.slot)

    def _decode_reads(self, what: str) -> tuple[slice | torch.Tensor, torch.Tensor | None,
                                                list[tuple[slice, tuple[int, ...]]]]:
        """What a decode step reads of the active windows (post-RoPE codes only): which ledger
        entries (a slice when they lead the ledger in layout order, as ``rebuild`` keeps them, else
        their indices), their holes [n, w] (None when there are none) and per sequence (its windows
        among those, its windows per KV head)."""
        if self.rope is not None:
            raise ValueError(f"{what} need post-RoPE codes: pre-RoPE keys must be rotated back per position")
        layout = self._layout()
        take = slice(0, self.num_active) if layout.prefix else layout.idx
        holes = None if layout.full else self.positions[take] < 0
        spans, start = [], 0
        for count, per_head in zip(layout.windows_per_sequence, layout.windows_per_head):
            spans.append((slice(start, start + count), per_head))  # ordered by row: by sequence, then head
            start += count
        return take, holes, spans

    def rotated_entries(self) -> list[RotatedEntries]:
        """Per sequence, its active windows flat, grouped by KV head and left in their quantization
        basis: keys dequantized, values as codes and grid, for
        ``attention.decode.decode_attention_with_rotated``. Slices of the ledger, not gathers."""
        take, holes, spans = self._decode_reads("rotated entries")
        c, w, d = self.codes, self.window, self.head_dim
        keys = dequantize_keys(c.key_codes[take], *c.key_grid(take))
        value_codes = unpack_int2_float(c.value_codes[take])
        value_scale, value_zero = c.value_scale[take].float(), c.value_zero[take].float()
        return [RotatedEntries(keys[span].reshape(-1, d), value_codes[span].reshape(-1, d),
                               value_scale[span].reshape(-1), value_zero[span].reshape(-1),
                               tuple(n * w for n in per_head), None if holes is None else holes[span].reshape(-1))
                for span, per_head in spans]

    def packed_windows(self) -> list[PackedWindows]:
        """Per sequence, its active windows as stored (codes and grids), grouped by KV head, for the
        CPU kernel; nothing is decoded or expanded. Kept until the layout changes."""
        if self._packed_cache is None:
            take, holes, spans = self._decode_reads("packed windows")
            c = self.codes
            parts = (c.key_codes[take], c.key_scale[take], c.key_zero[take], c.key_ref[take], c.value_codes[take],
                     c.value_scale[take], c.value_zero[take])
            self._packed_cache = [
                PackedWindows(*(t[span] for t in parts), head_windows=torch.tensor(per_head, dtype=torch.long),
                              holes=None if holes is None else holes[span])
                for span, per_head in spans]
        return self._packed_cache

    def add_state(self, name: str, padded: torch.Tensor, slot: torch.Tensor) -> None:
        """Add a [B, H, Lq] quantity laid out like ``view`` (``slot`` from that view) to the entries' state."""
        keep = slot >= 0
        if bool(keep.any()):
            self.state[name].view(-1).index_add_(0, slot[keep], padded[keep].float())

    # ------------------------------------------------------------------ routing
    def rebuild(self, keep: torch.Tensor, active: torch.Tensor, refreshed: RefreshedSlots | None,
                new: "NewWindows | None") -> None:
        """Keep ledger entries ``keep`` [n] with activity ``active`` [n]; ``refreshed`` overwrites
        positions/modality/state of kept entries (rows given by ``refreshed.index``, into the
        kept order) and ``new`` appends freshly quantized windows (active). The spill tier
        follows the ledger: kept entries keep their host copies, dropped ones free them. The
        result is in layout order (``_layout_order``), its codes gathered once."""
        idx = torch.nonzero(keep).flatten()
        added = new is not None and len(new.codes) > 0
        if self.spill is not None and added and (new.spill is None or len(new.spill) != len(new.codes)):
            raise RuntimeError("spill tier: every newly quantized window needs its host copy")
        row, wid = self.row[idx], self.window_id[idx]
        positions, modality = self.positions[idx], self.modality[idx]
        state = {n: t[idx] for n, t in self.state.items()}
        act = active[idx]
        if refreshed is not None and refreshed.index.numel():
            at = refreshed.index
            positions[at] = refreshed.positions
            modality[at] = refreshed.modality
            for n in self.state_names:
                state[n][at] = refreshed.state[n]
        codes, spill, src = self.codes, self.spill, idx  # the result's windows: codes[src]
        if added:
            codes = QuantizedWindows.cat([codes, new.codes])
            if spill is not None:
                spill = SpillCopies.cat([spill, new.spill], self.pin_spill)
            src = torch.cat([idx, len(self) + torch.arange(len(new.codes), device=self.device)])
            row, wid = torch.cat([row, new.row]), torch.cat([wid, new.window_id])
            positions, modality = torch.cat([positions, new.positions]), torch.cat([modality, new.modality])
            state = {n: torch.cat([state[n], new.state[n]]) for n in self.state_names}
            act = torch.cat([act, torch.ones(len(new.codes), dtype=torch.bool, device=self.device)])
        order = self._layout_order(row, wid, act)
        if order is not None:
            src, row, wid, act = src[order], row[order], wid[order], act[order]
            positions, modality = positions[order], modality[order]
            state = {n: t[order] for n, t in state.items()}
        if not (src.numel() == len(codes) and bool((src == torch.arange(len(codes), device=self.device)).all())):
            codes = codes.select(src)
            if spill is not None:
                spill = spill.select(src, self.pin_spill)
        self.codes, self.spill, self.row, self.window_id = codes, spill, row, wid
        self.positions, self.modality, self.state, self.active = positions, modality, state, act
        self._num_active = int(act.sum())
        self._forget_layout()

    def _layout_order(self, row: torch.Tensor, window_id: torch.Tensor, active: torch.Tensor) -> torch.Tensor | None:
        """The permutation that puts a ledger in layout order: active windows first, by row (sequence,
        then KV head) and window id; dormant ones after, in their order (None: already in it). Why:
        every decode step reads the active windows, and in this order it reads them as slices."""
        n = row.numel()
        if n == 0:
            return None
        span = int(window_id.max()) + 1
        rank = torch.where(active, row * span + window_id,
                           self.batch_size * self.num_kv_heads * span + torch.arange(n, device=self.device))
        order = torch.argsort(rank)
        return None if bool((order == torch.arange(n, device=self.device)).all()) else order

    def _put_in_layout_order(self) -> None:
        """Reorder the ledger into layout order (one copy, when it is not in it already)."""
        order = self._layout_order(self.row, self.window_id, self.active)
        if order is not None:
            self._take(order)

    def _take(self, idx: torch.Tensor) -> None:
        """Keep ledger entries ``idx`` (in that order) in every ledger-aligned tensor."""
        self.codes = self.codes.select(idx)
        self.row, self.window_id = self.row[idx], self.window_id[idx]
        self.positions, self.modality = self.positions[idx], self.modality[idx]
        self.state = {k: t[idx] for k, t in self.state.items()}
        self.active = self.active[idx]
        if self.spill is not None:
            self.spill = self.spill.select(idx, self.pin_spill)
        self._forget_layout()

    def repeat_batch(self, repeats: int) -> None:
        """Repeat every sequence's windows ``repeats`` times (as ``VarlenKVStore.repeat_batch``)."""
        if repeats == 1:
            return
        H = self.num_kv_heads
        b, h = self.row // H, self.row % H
        n = len(self)
        idx = torch.arange(n, device=self.device).repeat(repeats)
        copy = torch.arange(repeats, device=self.device).repeat_interleave(n)
        row = (b[idx] * repeats + copy) * H + h[idx]
        self._take(idx)
        self.row = row
        self._num_active *= repeats
        self.batch_size *= repeats
        self._put_in_layout_order()


def _into(x: torch.Tensor, basis: torch.Tensor | None) -> torch.Tensor:
    return x if basis is None else x.float() @ basis


def _same_basis(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a is b or (a.shape == b.shape and a.device == b.device and bool(torch.equal(a, b)))


def _out_of(x: torch.Tensor, basis: torch.Tensor | None) -> torch.Tensor:
    return x if basis is None else x @ basis.T


@dataclass
class NewWindows:
    """Windows quantized at a routing event, with their metadata."""

    codes: QuantizedWindows
    row: torch.Tensor
    window_id: torch.Tensor
    positions: torch.Tensor
    modality: torch.Tensor
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    spill: SpillCopies | None = None  # their original FP copies on the host (spill tier only)
