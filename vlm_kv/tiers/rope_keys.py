"""Undo and redo RoPE on cached keys, for INT2 windows quantized before rotary embedding.

Cached keys are post-RoPE: each channel pair is rotated by an angle that grows with the
position. KIVI and QEvict quantize keys per channel; before RoPE a channel's outliers sit in the
same channels for every token, after RoPE they rotate into their pair channel at a rate set by
the position. ``KeyRotation`` takes keys back to pre-RoPE at their stored positions before
quantization and rotates dequantized keys forward again before attention.

Standard RoPE only (Llama, Qwen2/3, SmolLM2 and the LLaVA language models): Qwen-VL's M-RoPE
rotates by three position components that the cache does not store, so it is refused.
"""

from __future__ import annotations

import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class KeyRotation:
    def __init__(self, inv_freq: torch.Tensor, scaling: float = 1.0) -> None:
        self.inv_freq = inv_freq.detach().float()
        self.scaling = float(scaling)

    @classmethod
    def from_model(cls, model: torch.nn.Module, uses_mrope: bool) -> "KeyRotation":
        if uses_mrope:
            raise ValueError("key_rope='pre' needs standard RoPE: this model uses M-RoPE (Qwen-VL), whose "
                             "three position components the cache does not store; use key_rope='post'")
        found = [m for name, m in model.named_modules() if name.endswith("rotary_emb") and hasattr(m, "inv_freq")
                 and "visual" not in name and "vision" not in name]
        if not found:
            raise ValueError(f"key_rope='pre': no rotary embedding with inv_freq found in {type(model).__name__}")
        rotary = found[0]
        return cls(rotary.inv_freq, getattr(rotary, "attention_scaling", 1.0))

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.clamp(min=0).float()[..., None] * self.inv_freq.to(positions.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    def unrotate(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Post-RoPE keys [..., D] at ``positions`` [...] -> pre-RoPE keys, float32."""
        cos, sin = self._cos_sin(positions)
        k = keys.float()
        return (k * cos - _rotate_half(k) * sin) / self.scaling

    def rotate(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE keys [..., D] -> post-RoPE at ``positions`` [...], float32."""
        cos, sin = self._cos_sin(positions)
        k = keys.float()
        return (k * cos + _rotate_half(k) * sin) * self.scaling
