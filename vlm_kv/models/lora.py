"""Low-rank adapters on a model's linear layers, trained as parametrizations and shipped merged.

    spec = LoRASpec(rank=8, alpha=16.0, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    adapters = attach_lora(model.model.language_model, spec)   # training: y = W x + (alpha/rank) B A x
    state = lora_state(adapters)                               # {"layers.0.self_attn.q_proj.A": ...}
    merge_lora(fresh_language_model, state, spec)              # inference: weights changed in place

Training adds the low-rank path to each target ``nn.Linear``'s output with a forward hook, so
the module stays a stock ``nn.Linear`` that every attention implementation and cache hook
already handles, and the frozen weight (bfloat16 while training) is never rebuilt: a small
update added to a bfloat16 weight would round away, while added to the activations it does not.
Inference merges the product into the weight once (tested equal to the hooked path): the loaded
model has no extra modules and no extra cost per token. ``B`` starts at zero, so an attached
adapter leaves the model's outputs unchanged until it is trained (tested).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LoRASpec:
    """Which linear layers get an adapter, its rank and its scale (``alpha / rank``)."""

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if not self.targets:
            raise ValueError("LoRA needs at least one target layer name")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict:
        return {**asdict(self), "targets": list(self.targets)}

    @classmethod
    def from_dict(cls, data: dict) -> "LoRASpec":
        return cls(rank=int(data["rank"]), alpha=float(data["alpha"]), targets=tuple(data["targets"]))


class LoRADelta(nn.Module):
    """One adapter: adds ``scale * B (A x)`` to its layer's output (A: rank x in, B: out x rank,
    float32 parameters)."""

    def __init__(self, out_features: int, in_features: int, spec: LoRASpec):
        super().__init__()
        self.scale = spec.scale
        self.A = nn.Parameter(torch.empty(spec.rank, in_features))
        self.B = nn.Parameter(torch.zeros(out_features, spec.rank))
        nn.init.kaiming_uniform_(self.A, a=5 ** 0.5)
        self.handle = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * F.linear(F.linear(x, self.A.to(x.dtype)), self.B.to(x.dtype))

    def hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return output + self(args[0]).to(output.dtype)


def _targets(module: nn.Module, spec: LoRASpec) -> dict[str, nn.Linear]:
    found = {name: m for name, m in module.named_modules()
             if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in spec.targets}
    if not found:
        raise ValueError(f"no nn.Linear named {list(spec.targets)} in {type(module).__name__}")
    return found


def attach_lora(module: nn.Module, spec: LoRASpec) -> dict[str, LoRADelta]:
    """Register an adapter on every target linear layer of ``module``; returns them by layer name."""
    adapters = {}
    for name, linear in _targets(module, spec).items():
        if getattr(linear, "_lora_attached", False):
            raise ValueError(f"{name} already has a LoRA adapter; attach once")
        delta = LoRADelta(linear.out_features, linear.in_features, spec).to(linear.weight.device)
        delta.handle = linear.register_forward_hook(delta.hook)
        linear._lora_attached = True
        adapters[name] = delta
    return adapters


def detach_lora(module: nn.Module, adapters: dict[str, LoRADelta]) -> None:
    """Remove attached adapters' hooks (the layers compute their plain output again)."""
    layers = dict(module.named_modules())
    for name, delta in adapters.items():
        delta.handle.remove()
        layers[name]._lora_attached = False


def lora_state(adapters: dict[str, LoRADelta]) -> dict[str, torch.Tensor]:
    """The adapters' float32 tensors, keyed ``<layer>.A`` / ``<layer>.B``."""
    state = {}
    for name, delta in adapters.items():
        state[f"{name}.A"] = delta.A.detach().float().contiguous()
        state[f"{name}.B"] = delta.B.detach().float().contiguous()
    return state


def _check_keys(layers, state: dict[str, torch.Tensor]) -> None:
    """Every layer has its A and B in ``state`` and nothing else is there."""
    expected = {f"{n}.{p}" for n in layers for p in ("A", "B")}
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ValueError(f"LoRA weights do not match the model (missing {sorted(missing)[:3]}, "
                         f"unexpected {sorted(unexpected)[:3]})")


def load_lora_state(adapters: dict[str, LoRADelta], state: dict[str, torch.Tensor]) -> None:
    """Copy saved adapter tensors into attached adapters (a resumed training run)."""
    _check_keys(adapters, state)
    with torch.no_grad():
        for name, delta in adapters.items():
            delta.A.copy_(state[f"{name}.A"])
            delta.B.copy_(state[f"{name}.B"])


@torch.no_grad()
def grow_lora(adapters: dict[str, LoRADelta], spec: LoRASpec, state: dict[str, torch.Tensor],
              saved: LoRASpec) -> None:
    """Start larger adapters (``spec``) from smaller trained ones (``saved``) so that the model
    computes exactly what it did: each saved layer's ``A`` fills the first ``saved.rank`` rows, its
    ``B`` (rescaled by ``saved.scale / spec.scale``) the first columns, the other columns of ``B``
    stay zero; layers the saved adapters did not cover start fresh (``B`` = 0). Refuses a spec that
    drops a saved target or lowers the rank: that would change the model."""
    if spec.rank < saved.rank or not set(saved.targets) <= set(spec.targets):
        raise ValueError(f"cannot grow LoRA adapters {saved.to_dict()} into {spec.to_dict()}: the rank may only "
                         "rise and every saved target must stay")
    covered = {name for name in adapters if name.rsplit(".", 1)[-1] in saved.targets}
    _check_keys(covered, state)
    ratio = saved.scale / spec.scale
    for name in covered:
        delta = adapters[name]
        delta.A[: saved.rank].copy_(state[f"{name}.A"])
        delta.B.zero_()
        delta.B[:, : saved.rank].copy_(state[f"{name}.B"] * ratio)


@torch.no_grad()
def merge_lora(module: nn.Module, state: dict[str, torch.Tensor], spec: LoRASpec) -> int:
    """Add ``scale * B @ A`` to each target layer's weight in place (computed in float32, stored
    in the weight's dtype); returns the number of layers changed. Every target must have its
    tensors and no tensor may be left over: a partial merge would silently be another model."""
    layers = _targets(module, spec)
    _check_keys(layers, state)
    for name, linear in layers.items():
        if getattr(linear, "_lora_attached", False):
            raise ValueError(f"{name} has a training adapter attached; merge into a plain model")
        a, b = state[f"{name}.A"].float(), state[f"{name}.B"].float()
        if a.shape != (spec.rank, linear.in_features) or b.shape != (linear.out_features, spec.rank):
            raise ValueError(f"{name}: LoRA shapes {tuple(a.shape)}, {tuple(b.shape)} do not fit "
                             f"a {linear.out_features} x {linear.in_features} layer at rank {spec.rank}")
        merged = linear.weight.float() + spec.scale * (b @ a)
        linear.weight.copy_(merged.to(linear.weight.dtype))
    return len(layers)


__all__ = ["LoRASpec", "LoRADelta", "attach_lora", "detach_lora", "grow_lora", "lora_state", "load_lora_state", "merge_lora"]
