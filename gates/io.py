"""Saving and loading gates: safetensors weights plus a JSON config naming the model they fit."""

from __future__ import annotations

import json
import os
from dataclasses import asdict

import torch
from safetensors.torch import load_file, save_file

from vlm_kv.gates.retention_gate import GateConfig, RetentionGates

WEIGHTS = "gates.safetensors"
CONFIG = "gate_config.json"


class GateMismatchError(ValueError):
    """Gates trained for another model (or a corrupt gate folder)."""


def save_gates(gates: RetentionGates, folder: str, dtype: torch.dtype = torch.float32) -> None:
    """Write ``gates.safetensors`` + ``gate_config.json``; ``dtype=torch.float16`` halves the file."""
    os.makedirs(folder, exist_ok=True)
    tensors = {k: v.detach().to(dtype).contiguous().cpu() for k, v in gates.state_dict().items()}
    save_file(tensors, os.path.join(folder, WEIGHTS))
    with open(os.path.join(folder, CONFIG), "w") as fh:
        json.dump(asdict(gates.config), fh, indent=2, sort_keys=True)


def load_config(folder: str) -> GateConfig:
    cfg_path = os.path.join(folder, CONFIG)
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"no gates in {folder}: expected {CONFIG} and {WEIGHTS}")
    try:
        with open(cfg_path) as fh:
            return GateConfig(**json.load(fh))
    except (json.JSONDecodeError, TypeError, ValueError) as err:
        raise GateMismatchError(f"corrupt gate config {cfg_path}: {err}") from None


def load_gates(folder: str, fingerprint: dict | None = None, *, any_family: bool = False) -> RetentionGates:
    """Load gates from ``folder``; with a model's ``fingerprint`` (``ModelAdapter.fingerprint()``),
    refuse gates trained for a different model. ``any_family`` accepts gates of another model
    family whose language model has the same config (fine-tuning a VLM's gates from its text
    model's: the gates see only the language model's hidden states)."""
    config = load_config(folder)
    w_path = os.path.join(folder, WEIGHTS)
    if not os.path.isfile(w_path):
        raise FileNotFoundError(f"no gates in {folder}: expected {CONFIG} and {WEIGHTS}")
    if fingerprint is not None:
        check_fits(config, fingerprint, any_family=any_family)
    gates = RetentionGates(config)
    try:
        state = load_file(w_path)
        gates.load_state_dict(state)
    except Exception as err:  # safetensors raises several types for damaged files
        raise GateMismatchError(f"corrupt or mismatched gate weights {w_path}: {err}") from None
    return gates.eval()


def check_fits(config: GateConfig, fingerprint: dict, *, any_family: bool = False) -> None:
    """Refuse gates whose recorded model (family, config hash) is not the model with ``fingerprint``
    (with ``any_family``, only the language model's config hash must match)."""
    expected = fingerprint
    trained = config.model or {}
    identity = ("config_hash",) if any_family else ("family", "config_hash")
    if any(trained.get(k) != expected.get(k) for k in identity):
        def brief(fp: dict) -> str:
            return (f"{fp.get('architecture')} ({fp.get('num_layers')} layers, {fp.get('num_kv_heads')} KV heads, "
                    f"hidden {fp.get('hidden_size')}, config {fp.get('config_hash')})")
        raise GateMismatchError(
            f"these gates were trained for {brief(trained)} but the model is {brief(expected)}; "
            "train gates for this model with `vlm-kv train-gates`"
        )
