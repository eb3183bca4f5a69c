"""Running gates inside a stock model without touching its code.

A forward pre-hook on each self-attention module sees the hidden state the q/k/v projections
see, runs that layer's gate, and passes log beta on: to the compressed cache (inference: stored
beside each new entry) or to the attention function (training: soft retention in the logits).
"""

from __future__ import annotations

from typing import Any

import torch

from vlm_kv.attention.handoff import stash_log_beta
from vlm_kv.cache.hooks import attach, inference_gate_hook  # noqa: F401  (inference_gate_hook: re-exported)
from vlm_kv.gates.retention_gate import RetentionGates


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor:
    return kwargs.get("hidden_states", args[0] if args else None)


class SoftRetention:
    """Context manager for gate training: every attention layer of ``model`` applies soft
    retention with ``gates``; ``log_betas`` collects each layer's [B, H, T] log beta (with
    gradients) for the capacity loss.

        with SoftRetention(model, gates) as soft:
            out = model(input_ids)
            cap = capacity_loss(soft.log_betas, ...)
    """

    def __init__(self, model: torch.nn.Module, gates: RetentionGates) -> None:
        self.model = model
        self.gates = gates
        self.adapter = attach(model)
        self.log_betas: list[torch.Tensor] = []
        self._handles: list = []

    def _hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = _hidden(args, kwargs)
        log_beta = self.gates.log_beta(module.layer_idx, hidden)
        self.log_betas.append(log_beta)
        stash_log_beta(log_beta)

    def __enter__(self) -> "SoftRetention":
        self.log_betas = []
        for module in self.adapter.attention_modules(self.model):
            self._handles.append(module.register_forward_pre_hook(self._hook, with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        stash_log_beta(None)
