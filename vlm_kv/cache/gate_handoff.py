"""The retention gates' outputs on their way to the layers' stores.

The gates read the hidden state an attention module sees, before its ``cache.update``
(``vlm_kv.cache.hooks``). A prefill's gate runs right there and its output (log beta of the
tokens about to enter the layer) waits here until the layer stores them; a decode step's gate is
deferred: the hook keeps the hidden state, and one batched call at the end of the forward serves
every layer. Every hand-off must be consumed within its forward.
"""

from __future__ import annotations

import torch

from vlm_kv.storage.ledger import CacheMisuseError
from vlm_kv.storage.store import tensor_bytes

__all__ = ["GateHandOff"]


class GateHandOff:
    """One cache's gate outputs between the gate hook and the layers' stores."""

    def __init__(self, gates: torch.nn.Module | None, num_layers: int) -> None:
        self.gates = gates
        self.num_layers = num_layers
        self.stash: dict[int, torch.Tensor] = {}  # log beta of the tokens about to enter a layer
        # the hidden state each deferred gate will read ([L, B, d], one row per layer), which
        # layers have it, and which of those already stored their token
        self.inputs: torch.Tensor | None = None
        self.waiting: set[int] = set()
        self.stored: set[int] = set()

    def stash_log_beta(self, layer_idx: int, log_beta: torch.Tensor) -> None:
        """Gate output for the tokens about to enter ``layer_idx`` ([B, H, Q])."""
        self.stash[layer_idx] = log_beta

    def defer(self, layer_idx: int, hidden: torch.Tensor) -> None:
        """Keep the hidden state of a one-token step entering ``layer_idx`` ([B, 1, d]); its
        gate runs with every other layer's at the end of the forward."""
        b, _, d = hidden.shape
        if self.inputs is None or self.inputs.shape[1:] != (b, d) or self.inputs.dtype != hidden.dtype:
            self.inputs = hidden.new_empty(self.num_layers, b, d)
        self.inputs[layer_idx].copy_(hidden[:, 0])
        self.waiting.add(layer_idx)

    def take(self, layer_idx: int, batch: int, q: int) -> torch.Tensor | None:
        """Layer ``layer_idx`` just stored ``batch`` x ``q`` tokens: their log beta ([B, H, Q]), or
        None when their gate was deferred (its output comes from ``deferred_log_betas``)."""
        if self._take_deferred(layer_idx, batch, q):
            return None
        log_beta = self.stash.pop(layer_idx, None)
        if log_beta is None or log_beta.shape[0] != batch or log_beta.shape[-1] != q:
            raise CacheMisuseError(
                f"no gate output for layer {layer_idx}: the gate hook did not run (was the cache built "
                "with vlm_kv.make_cache for this model?)"
            )
        return log_beta

    def _take_deferred(self, layer_idx: int, batch: int, q: int) -> bool:
        if layer_idx not in self.waiting:
            return False
        if q != 1 or self.inputs.shape[1] != batch:
            raise CacheMisuseError(f"layer {layer_idx} stored {batch}x{q} tokens but its gate saw {self.inputs.shape[1]}x1")
        self.waiting.discard(layer_idx)
        self.stored.add(layer_idx)
        return True

    def check_consumed(self) -> None:
        """End of a forward: every gate output computed was stored by its layer."""
        left = sorted(set(self.stash) | self.waiting)
        if left:
            self.clear()
            raise CacheMisuseError(f"gate outputs for layers {left} were computed but never stored in the cache")

    def deferred_log_betas(self) -> list[tuple[int, torch.Tensor]]:
        """End of a forward: the deferred gates in one batched call; (layer, log beta [B, H, 1])
        for every layer that stored its token. The hand-off is one forward's: nothing is kept."""
        if not self.stored:
            return []
        with torch.no_grad():
            log_beta = self.gates.log_beta_stacked(self.inputs)  # [L, B, H]
        out = [(idx, log_beta[idx].unsqueeze(-1)) for idx in sorted(self.stored)]
        self.stored.clear()
        self.inputs = None
        return out

    def clear(self) -> None:
        self.stash.clear()
        self.waiting.clear()
        self.stored.clear()

    def held_bytes(self) -> int:
        """Bytes of gate outputs and inputs waiting for their layer."""
        return tensor_bytes(*self.stash.values(), self.inputs)
