"""Per-family adapters: what the KV-cache library needs to know about a stock model.

An adapter is built from a model or a config (``get_adapter``) and records the language
model's attention geometry, the multimodal placeholder token ids, and how to reach the
language model's self-attention modules. Nothing here patches or wraps the model.

Layout facts (transformers 5.x):

* text LLMs (llama, qwen2, qwen3): ``XForCausalLM.model.layers[i].self_attn``
* VLMs (qwen2_vl, qwen2_5_vl, qwen3_vl, llava, llava_next, llava_onevision):
  ``XForConditionalGeneration.model.language_model.layers[i].self_attn``
  (4.x checkpoints-era code had ``.language_model.model.layers``; also handled).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

__all__ = [
    "MODALITIES",
    "SUPPORTED_FAMILIES",
    "UnsupportedModelError",
    "ModelAdapter",
    "get_adapter",
]

MODALITIES = ("text", "image", "video")  # modality codes 0, 1, 2
TEXT, IMAGE, VIDEO = 0, 1, 2

SUPPORTED_FAMILIES: tuple[str, ...] = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "llava",
    "llava_next",
    "llava_onevision",
)

_TEXT_FAMILIES = frozenset({"llama", "qwen2", "qwen3"})
_MROPE_FAMILIES = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl"})

# Class name used for "architecture" when neither the config nor a model says.
_DEFAULT_ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "llava": "LlavaForConditionalGeneration",
    "llava_next": "LlavaNextForConditionalGeneration",
    "llava_onevision": "LlavaOnevisionForConditionalGeneration",
}

# Dotted paths (from the object handed to attention_modules) to the decoder layer list,
# tried in order. Covers the full model, the base model and the bare language model.
_LAYER_PATHS = (
    "model.language_model.layers",  # 5.x VLM  XForConditionalGeneration
    "language_model.layers",  # 5.x VLM base model (XModel)
    "model.language_model.model.layers",  # 4.x-style VLM wrapping a CausalLM
    "language_model.model.layers",
    "model.layers",  # XForCausalLM
    "layers",  # XModel / XTextModel
)


class UnsupportedModelError(ValueError):
    """The model's ``model_type`` is not one of ``SUPPORTED_FAMILIES``."""

    def __init__(self, model_type, detail: str = ""):
        self.model_type = model_type
        msg = (
            f"unsupported model_type {model_type!r}; supported families: "
            f"{', '.join(SUPPORTED_FAMILIES)}"
        )
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)


def _resolve(obj, dotted: str):
    for name in dotted.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


@dataclass(frozen=True)
class ModelAdapter:
    family: str
    num_layers: int  # decoder layers of the language model
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    image_token_id: int | None
    video_token_id: int | None
    uses_mrope: bool  # Qwen2-VL / 2.5-VL / 3-VL
    text_config_key: str | None  # "text_config" for VLMs, None for text-only LLMs
    # extras (defaulted so positional construction with the fields above keeps working)
    architecture: str = ""
    vocab_size: int = 0

    # ------------------------------------------------------------------ modality

    def modality_of(self, input_ids: torch.LongTensor) -> torch.Tensor:
        """Per-token modality codes, same shape as ``input_ids``, dtype uint8.

        0 text (including vision start/end markers and padding), 1 image placeholder,
        2 video placeholder. Matches the ``mm_token_type_ids`` convention of Qwen VL.
        """
        ids = torch.as_tensor(input_ids)
        out = torch.zeros(ids.shape, dtype=torch.uint8, device=ids.device)
        if self.image_token_id is not None:
            out[ids == self.image_token_id] = IMAGE
        if self.video_token_id is not None:
            out[ids == self.video_token_id] = VIDEO
        return out

    # ------------------------------------------------------------------ modules

    def decoder_layers(self, model: torch.nn.Module) -> torch.nn.ModuleList:
        """The language model's decoder layer list (``num_layers`` long)."""
        seen = []
        for path in _LAYER_PATHS:
            layers = _resolve(model, path)
            if isinstance(layers, torch.nn.ModuleList) and len(layers) > 0:
                if all(hasattr(layer, "self_attn") for layer in layers):
                    if len(layers) == self.num_layers:
                        return layers
                    seen.append(f"{path} ({len(layers)} layers)")
        # Fallback: any ModuleList of decoder layers with the right length whose attention
        # modules carry layer_idx (vision blocks do not).
        for name, mod in model.named_modules():
            if (
                isinstance(mod, torch.nn.ModuleList)
                and len(mod) == self.num_layers
                and all(hasattr(getattr(layer, "self_attn", None), "layer_idx") for layer in mod)
            ):
                return mod
        raise ValueError(
            f"could not find the {self.num_layers} language-model decoder layers of "
            f"{type(model).__name__} (family {self.family!r}); tried {', '.join(_LAYER_PATHS)}"
            + (f"; found mismatching {', '.join(seen)}" if seen else "")
        )

    def attention_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The language model's self-attention modules in layer order (each has ``layer_idx``)."""
        mods = [layer.self_attn for layer in self.decoder_layers(model)]
        for i, m in enumerate(mods):
            if getattr(m, "layer_idx", None) != i:
                raise ValueError(
                    f"attention module {i} of {type(model).__name__} has layer_idx="
                    f"{getattr(m, 'layer_idx', None)!r}, expected {i}"
                )
        return mods

    # ------------------------------------------------------------------ identity

    def _structure(self) -> dict:
        return {
            "num_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
        }

    def fingerprint(self) -> dict:
        """Identity of the language model (structure only: not weights, not dtype)."""
        blob = json.dumps(self._structure(), sort_keys=True, separators=(",", ":"))
        return {
            "family": self.family,
            "architecture": self.architecture,
            "num_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_size": self.hidden_size,
            "config_hash": hashlib.sha256(blob.encode()).hexdigest()[:16],
        }


def _int_or_none(x):
    return None if x is None else int(x)


def _token_id(config, *names):
    for name in names:
        try:
            val = getattr(config, name)
        except AttributeError:
            continue
        if val is not None:
            return int(val)
    return None


def get_adapter(model_or_config) -> ModelAdapter:
    """Adapter for a ``PreTrainedModel`` (any nn.Module with ``.config``) or a config."""
    model = None
    if isinstance(model_or_config, torch.nn.Module):
        model = model_or_config
        config = getattr(model, "config", None)
        if config is None:
            raise UnsupportedModelError(None, f"{type(model).__name__} has no .config")
    else:
        config = model_or_config
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_FAMILIES:
        raise UnsupportedModelError(model_type)
    family = model_type

    if family in _TEXT_FAMILIES:
        text = config
        text_config_key = None
    else:
        text_config_key = "text_config"
        text = getattr(config, "text_config", None)
        if text is None:
            text = config.get_text_config()

    heads = int(text.num_attention_heads)
    hidden = int(text.hidden_size)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads

    if family in _TEXT_FAMILIES:
        image_token_id = video_token_id = None
    else:
        # LLaVA configs store *_token_index (attribute_map exposes *_token_id).
        image_token_id = _token_id(config, "image_token_id", "image_token_index")
        video_token_id = _token_id(config, "video_token_id", "video_token_index")

    archs = getattr(config, "architectures", None) or []
    if archs:
        architecture = archs[0]
    elif model is not None:
        architecture = type(model).__name__
    else:
        architecture = _DEFAULT_ARCHITECTURE[family]

    return ModelAdapter(
        family=family,
        num_layers=int(text.num_hidden_layers),
        num_attention_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        hidden_size=hidden,
        image_token_id=_int_or_none(image_token_id),
        video_token_id=_int_or_none(video_token_id),
        uses_mrope=family in _MROPE_FAMILIES,
        text_config_key=text_config_key,
        architecture=architecture,
        vocab_size=int(getattr(text, "vocab_size", 0) or 0),
    )
