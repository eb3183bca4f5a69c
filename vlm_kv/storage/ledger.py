"""What only the model's inputs know about the tokens entering a compressed cache.

The attention modules see keys and values, not token ids or the attention mask. A forward
pre-hook on the model (``vlm_kv.api``) announces each forward's modality codes and padding to
the ledger; the first layer's ``update`` takes the announcement, and every layer of that
forward reads the same record. The ledger also keeps, per sequence, how many real tokens it
has seen and where its first real token sits, which the budget and the attention sinks need.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlm_kv.models.adapters import ModelAdapter


class CacheMisuseError(RuntimeError):
    """The cache is used in a way it cannot honour (another model, beam search, cropping)."""


@dataclass
class ForwardRecord:
    """The tokens of one forward: modality codes and validity, [B, Q] each."""

    modality: torch.Tensor
    valid: torch.Tensor
    all_valid: bool = True  # no padding among these tokens (checked once per forward, not per layer)


@dataclass(frozen=True)
class Announcement:
    """What a forward's inputs said before it ran: modality codes and validity [B, Q], each None
    where the inputs did not say (embeddings without ids, no 2-D attention mask)."""

    modality: torch.Tensor | None
    valid: torch.Tensor | None


@dataclass(frozen=True)
class Counts:
    """Per sequence: real tokens seen and the position of the first one ([B] each, None before any)."""

    valid_tokens: torch.Tensor | None
    first_positions: torch.Tensor | None


class TokenLedger:
    def __init__(self, adapter: ModelAdapter) -> None:
        self.adapter = adapter
        self._announced: Announcement | None = None
        self._current: ForwardRecord | None = None
        self._before: Counts | None = None  # the counts before the forward in flight (to undo it)
        self.valid_tokens: torch.Tensor | None = None     # [B] real tokens seen per sequence
        self.first_positions: torch.Tensor | None = None  # [B] position of each sequence's first real token
        self.seen = 0                                     # tokens seen (padding included): the next position

    def announce(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, q_len: int | None) -> None:
        """Before a forward: what the inputs say about its tokens."""
        modality = self.adapter.modality_of(input_ids) if input_ids is not None else None
        valid = None
        if attention_mask is not None and attention_mask.dim() == 2 and q_len is not None:
            valid = attention_mask[:, -q_len:].bool()
        self._announced = Announcement(modality, valid)
        self._current = None

    def enter(self, batch: int, q: int, device: torch.device) -> ForwardRecord:
        """The record of the forward in flight; the first layer takes the announcement."""
        if self._current is not None:
            return self._current
        if self._announced is None:
            raise CacheMisuseError(
                "the compressed cache received keys/values from a forward that vlm_kv did not see: this cache "
                "was built by vlm_kv.make_cache for another model, or this model was never prepared with "
                "vlm_kv.make_cache / vlm_kv.attach; build a new cache with vlm_kv.make_cache(model, ...)"
            )
        modality, valid = self._announced.modality, self._announced.valid
        self._announced = None
        if modality is None or modality.shape != (batch, q):
            modality = torch.zeros(batch, q, dtype=torch.uint8, device=device)
        if valid is None or valid.shape != (batch, q):
            valid = torch.ones(batch, q, dtype=torch.bool, device=device)
        valid = valid.to(device)
        self._current = ForwardRecord(modality.to(device), valid, bool(valid.all()))
        self._before = Counts(self.valid_tokens, self.first_positions)
        self._count(self._current.valid)
        return self._current

    def end_forward(self) -> int:
        """After a forward: returns how many tokens it brought (0 if no layer stored any)."""
        record, self._current, self._announced = self._current, None, None
        if record is None:
            return 0
        q = record.valid.shape[1]
        self.seen += q
        return q

    def abort_forward(self) -> None:
        """The forward raised: forget its tokens, as if it never ran."""
        if self._current is not None:
            self.valid_tokens, self.first_positions = self._before.valid_tokens, self._before.first_positions
        self._current = self._announced = None

    def _count(self, valid: torch.Tensor) -> None:
        counts = valid.sum(dim=1).long()
        idx = torch.arange(valid.shape[1], device=valid.device) + self.seen
        first = torch.where(valid, idx, torch.full_like(idx, 2**62)).min(dim=1).values
        if self.valid_tokens is None:
            self.valid_tokens, self.first_positions = counts, first
        else:
            self.valid_tokens = self.valid_tokens + counts
            self.first_positions = torch.minimum(self.first_positions, first)

    def repeat_batch(self, repeats: int) -> None:
        if self.valid_tokens is not None:
            self.valid_tokens = self.valid_tokens.repeat_interleave(repeats)
            self.first_positions = self.first_positions.repeat_interleave(repeats)

    def reset(self) -> None:
        self.__init__(self.adapter)
