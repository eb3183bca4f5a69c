"""Learned retention gates (TrimKV / DBTrimKV).

A gate reads the hidden state entering a layer's attention block (after its input norm, the
tensor the q/k/v projections see) and predicts, per KV head, a retention rate beta in (0, 1):
an entry written at step i still matters at step t with weight beta ** (t - i). Eviction keeps
the entries with the highest ``(t - i) * log beta``.

DBTrimKV couples the gates: the last projection (and its bias) is one module shared by every
layer, so all layers and heads score on one scale and one global budget can be shared by
them. TrimKV gives each layer its own small gate. ``coupled=False`` keeps the DBTrimKV shape
with per-layer last projections (the paper's ablation).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from vlm_kv.policies.retention import retention_scores  # noqa: F401  (re-exported: gates score with it)

GATE_KINDS = ("dbtrimkv", "trimkv")


@dataclass
class GateConfig:
    kind: str = "dbtrimkv"
    hidden_size: int = 576
    num_layers: int = 30
    num_kv_heads: int = 3
    width: int = 64
    init_bias: float = 18.0
    coupled: bool = True
    model: dict = field(default_factory=dict)      # ModelAdapter.fingerprint() of the model trained for
    training: dict = field(default_factory=dict)   # budget and data the gates were trained with

    def __post_init__(self) -> None:
        if self.kind not in GATE_KINDS:
            raise ValueError(f"unknown gate kind {self.kind!r}; known: {', '.join(GATE_KINDS)}")


class LayerGateTrunk(nn.Module):
    """The per-layer part of a gate: d_model -> width features."""

    def __init__(self, hidden_size: int, width: int, depth: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(hidden_size, width), nn.SiLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.SiLU()]
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class RetentionGates(nn.Module):
    """All layers' gates of one model; ``log_beta(layer, hidden)`` -> [B, H, T] (float32, <= 0)."""

    def __init__(self, config: GateConfig) -> None:
        super().__init__()
        self.config = config
        depth = 2 if config.kind == "dbtrimkv" else 1
        self.trunks = nn.ModuleList(
            LayerGateTrunk(config.hidden_size, config.width, depth) for _ in range(config.num_layers)
        )
        shared = config.kind == "dbtrimkv" and config.coupled
        n_heads = config.num_kv_heads
        if shared:
            self.head = nn.Linear(config.width, n_heads, bias=False)
            self.bias = nn.Parameter(torch.full((n_heads,), float(config.init_bias)))
        else:
            self.heads = nn.ModuleList(nn.Linear(config.width, n_heads, bias=False) for _ in range(config.num_layers))
            self.biases = nn.Parameter(torch.full((config.num_layers, n_heads), float(config.init_bias)))
        self.shared = shared
        self._init_output()

    def _init_output(self) -> None:
        # Small output weights so the large bias dominates: untrained gates keep everything.
        heads = [self.head] if self.shared else list(self.heads)
        for h in heads:
            nn.init.normal_(h.weight, std=1e-3)

    def logits(self, layer_idx: int, hidden: torch.Tensor) -> torch.Tensor:
        feats = self.trunks[layer_idx](hidden.to(self.trunks[layer_idx].net[0].weight.dtype))
        if self.shared:
            return self.head(feats) + self.bias
        return self.heads[layer_idx](feats) + self.biases[layer_idx]

    def log_beta(self, layer_idx: int, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, d] -> log beta [B, H, T] in float32."""
        if torch.is_grad_enabled():
            return F.logsigmoid(self.logits(layer_idx, hidden).float()).transpose(1, 2)
        # Inference runs this once per layer per decode step: the same arithmetic as ``logits``,
        # with the functional ops called directly (module dispatch was ~half of its cost).
        x = hidden
        for module in self.trunks[layer_idx].net:
            x = F.linear(x.to(module.weight.dtype), module.weight, module.bias) if isinstance(module, nn.Linear) else F.silu(x)
        if self.shared:
            logits = F.linear(x, self.head.weight) + self.bias
        else:
            logits = F.linear(x, self.heads[layer_idx].weight) + self.biases[layer_idx]
        return F.logsigmoid(logits.float()).transpose(1, 2)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
