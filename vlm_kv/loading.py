"""One loader for the models the tools run: eval, gate training and the lmms-eval wrapper.

    model, processor = load_model_and_processor("/models/Qwen2.5-VL-7B-Instruct")
    model, tokenizer = load_model_and_processor("smollm2")

A folder whose ``config.json`` has a ``vision_config`` is a VLM: ``AutoModelForImageTextToText``
plus ``AutoProcessor``. Anything else (``smollm2``, a text model folder, a GGUF) goes through
``vlm_kv.smollm2.load_model``. Device: cuda when available unless given; dtype ``auto`` keeps
the checkpoint's dtype on GPU and uses float32 on CPU (half precision is slow and lossy there).
The model is returned in eval mode on its device.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

__all__ = ["is_vlm_folder", "resolve_device", "resolve_dtype", "load_vlm", "load_model_and_processor"]


def is_vlm_folder(path: str | os.PathLike) -> bool:
    """True when ``path`` is a folder whose config.json describes a vision-language model."""
    cfg = os.path.join(str(path), "config.json")
    if not os.path.isfile(cfg):
        return False
    with open(cfg, encoding="utf-8") as fh:
        return "vision_config" in json.load(fh)


def resolve_device(device: str | None) -> str:
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> Any:
    """``auto``: the checkpoint's dtype on an accelerator, float32 on CPU; else a torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return "auto" if not str(device).startswith("cpu") else torch.float32
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use auto, bfloat16, float16 or float32")
    return value


def load_vlm(path: str | os.PathLike, device: str | None = None, dtype: str | torch.dtype | None = "auto"):
    """A transformers VLM and its processor from a local folder: ``(model, processor)``."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = str(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model folder not found: {path} (a local folder with config.json and weights)")
    device = resolve_device(device)
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=resolve_dtype(dtype, device))
    model.to(device).eval()
    return model, processor


def load_model_and_processor(name: str | os.PathLike, device: str | None = None,
                             dtype: str | torch.dtype | None = "auto"):
    """A VLM folder via :func:`load_vlm`; ``smollm2`` or a text model via ``vlm_kv.smollm2.load_model``
    (that one stays on CPU in float32 unless ``device`` is given)."""
    name = str(name)
    if name != "smollm2" and is_vlm_folder(name):
        return load_vlm(name, device, dtype)
    from vlm_kv.smollm2 import load_model

    model, tokenizer = load_model(name)
    if device is not None:
        model.to(device)
    return model.eval(), tokenizer
