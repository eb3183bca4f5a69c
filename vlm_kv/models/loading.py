"""Loading a VLM from a local folder (``vlm_kv.models.named`` adds the models taken by name).

    model, processor = load_vlm("/models/Qwen2.5-VL-7B-Instruct")

A folder whose ``config.json`` has a ``vision_config`` is a VLM: ``AutoModelForImageTextToText``
plus ``AutoProcessor``. Device: cuda when available unless given; dtype ``auto`` keeps
the checkpoint's dtype on GPU and uses float32 on CPU (half precision is slow and lossy there).
The model is returned in eval mode on its device.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import torch
import transformers
from transformers import (
    AutoImageProcessor,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
)

__all__ = [
    "is_vlm_folder",
    "resolve_device",
    "resolve_dtype",
    "load_processor",
    "without_video_processor",
    "load_vlm",
]

_NO_VIDEO_CLASSES: dict = {}
# a folder saved without a video processor on purpose (``vlm_kv.testing.save_tiny_vlm``) says so here,
# so loading it image-only is what was asked for, not a loss worth a warning
IMAGE_ONLY_MARKER = "vlm_kv_image_only.json"


def without_video_processor(cls):
    """Subclass of a stock processor class that has no ``video_processor``.

    Stock Qwen-VL / LLaVA-OneVision processors require a video processor, and transformers'
    video processors need torchvision (whose PyPI builds do not load beside a CPU-only torch).
    ``ProcessorMixin`` derives its sub-processors from the ``__init__`` signature, so a
    signature without ``video_processor`` drops it; images and text behave exactly as in ``cls``.
    """
    if cls not in _NO_VIDEO_CLASSES:

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            cls.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

        _NO_VIDEO_CLASSES[cls] = type(f"{cls.__name__}WithoutVideo", (cls,), {"__init__": __init__})
    return _NO_VIDEO_CLASSES[cls]


def load_processor(path: str | os.PathLike):
    """``AutoProcessor.from_pretrained(path)``; when only its video processor cannot load
    (torchvision missing or broken, or no video config saved), the same processor without
    video, with a warning saying how to get video back: images and text work, video inputs
    raise in the processor. A folder marked image-only (``IMAGE_ONLY_MARKER``) loads so silently."""

    path = str(path)
    image_only = os.path.isfile(os.path.join(path, IMAGE_ONLY_MARKER))
    try:
        if not image_only:
            return AutoProcessor.from_pretrained(path)
    except (OSError, ImportError, ValueError) as exc:
        if "video" not in str(exc).lower() and "torchvision" not in str(exc).lower():
            raise
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0].split(". ")[0]
    with open(os.path.join(path, "processor_config.json"), encoding="utf-8") as fh:
        name = json.load(fh).get("processor_class")
    cls = getattr(transformers, str(name), None)
    if cls is None:
        raise ValueError(f"{path}: processor_class {name!r} is not a transformers processor class")
    tokenizer = AutoTokenizer.from_pretrained(path)
    processor = without_video_processor(cls)(image_processor=AutoImageProcessor.from_pretrained(path),
                                             tokenizer=tokenizer, chat_template=tokenizer.chat_template)
    if not image_only:
        warnings.warn(_no_video_message(path, str(name), reason), RuntimeWarning, stacklevel=2)
    return processor


def _no_video_message(path: str, name: str, reason: str) -> str:
    """What happened, what still works, and what to do to feed videos."""
    return (f"{path}: loaded {name} without its video processor ({reason}). Images and text work; video "
            f"inputs raise. To feed videos: install a torchvision build that loads beside torch "
            f"{torch.__version__} (transformers' video processors need it) and keep the checkpoint's video "
            f"processor config (video_preprocessor_config.json) in the folder. A folder meant for images only "
            f"can say so with an empty {IMAGE_ONLY_MARKER} file, which silences this warning.")


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

    path = str(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model folder not found: {path} (a local folder with config.json and weights)")
    device = resolve_device(device)
    processor = load_processor(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=resolve_dtype(dtype, device))
    model.to(device).eval()
    return model, processor
