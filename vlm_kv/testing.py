"""Test scaffolding: random-weight tiny models, inputs and processors (never for quality claims).

Everything here is built from configs in memory (no hub access) and exists only to
exercise code paths: shapes, cache plumbing, modality bookkeeping, generation loops.
Outputs are meaningless.

Shared tiny vocabulary (``TINY_VOCAB_SIZE`` = 272 ids) for every family::

    0..15    special tokens (family specific names, same ids for all families)
    16..271  the 256 byte-level BPE byte tokens (no merges)

Special ids used by the models (``TINY_SPECIAL_IDS``):

    0 pad, 1 bos, 2 eos
    Qwen families:  3 <|im_start|>, 4 <|im_end|>, 5 <|vision_start|>, 6 <|vision_end|>,
                    7 <|image_pad|> (image_token_id), 8 <|video_pad|> (video_token_id)
    LLaVA families: 3 <image> (image_token_index), 4 <video> (video_token_index, OneVision)
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os

import torch
import transformers as tf
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
)
from transformers import PreTrainedTokenizerFast
from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

from vlm_kv.gates.retention_gate import GateConfig, RetentionGates
from vlm_kv.models.adapters import SUPPORTED_FAMILIES, get_adapter
from vlm_kv.models.loading import IMAGE_ONLY_MARKER, without_video_processor

__all__ = [
    "TINY_FAMILIES",
    "TINY_VOCAB_SIZE",
    "TINY_SPECIAL_IDS",
    "tiny_config",
    "tiny_model",
    "tiny_inputs",
    "tiny_processor",
    "tiny_tokenizer",
    "save_tiny_vlm",
]

# one tiny model per supported family
TINY_FAMILIES = SUPPORTED_FAMILIES
_TEXT_FAMILIES = ("llama", "qwen2", "qwen3")
_QWEN_VL_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
_LLAVA_FAMILIES = ("llava", "llava_next", "llava_onevision")

_NUM_SPECIAL = 16
TINY_VOCAB_SIZE = _NUM_SPECIAL + 256

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
QWEN_IM_START_ID, QWEN_IM_END_ID = 3, 4
QWEN_VISION_START_ID, QWEN_VISION_END_ID = 5, 6
QWEN_IMAGE_ID, QWEN_VIDEO_ID = 7, 8
LLAVA_IMAGE_ID, LLAVA_VIDEO_ID = 3, 4

TINY_SPECIAL_IDS = {
    "pad": PAD_ID,
    "bos": BOS_ID,
    "eos": EOS_ID,
    "qwen": {
        "<|im_start|>": QWEN_IM_START_ID,
        "<|im_end|>": QWEN_IM_END_ID,
        "<|vision_start|>": QWEN_VISION_START_ID,
        "<|vision_end|>": QWEN_VISION_END_ID,
        "<|image_pad|>": QWEN_IMAGE_ID,
        "<|video_pad|>": QWEN_VIDEO_ID,
    },
    "llava": {"<image>": LLAVA_IMAGE_ID, "<video>": LLAVA_VIDEO_ID},
}

# Language model geometry shared by all families.
_HIDDEN = 64
_INTERMEDIATE = 128
_HEADS = 4
_KV_HEADS = 2
_HEAD_DIM = 16
_MAX_POS = 2048

# Vision geometry.
_QWEN_PATCH = 4  # Qwen vision patch size (pixels); temporal patch 2, spatial merge 2
_QWEN_TEMPORAL_PATCH = 2
_QWEN_MERGE = 2
_LLAVA_IMAGE_SIZE = 16  # CLIP / SigLIP input resolution
_LLAVA_PATCH = 4  # -> 4x4 = 16 patches per tile
# (height, width) pinpoints, multiples of the tile size; kept small so anyres stays tiny.
_LLAVA_PINPOINTS = [[16, 32], [32, 16], [32, 32]]

# Image grids (t, h, w in patches) used by tiny_inputs for Qwen, cycled per image index.
_QWEN_GRIDS = ((1, 8, 8), (1, 4, 8), (1, 8, 4), (1, 4, 4))
# Original image sizes (height, width) used by tiny_inputs for LLaVA-NeXT / OneVision.
_LLAVA_IMAGE_SIZES = ((16, 16), (16, 32), (32, 16), (24, 24))


def _check_family(family: str) -> None:
    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown tiny family {family!r}; expected one of {TINY_FAMILIES}")


def _text_kwargs(num_layers: int) -> dict:
    return dict(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=_HIDDEN,
        intermediate_size=_INTERMEDIATE,
        num_hidden_layers=num_layers,
        num_attention_heads=_HEADS,
        num_key_value_heads=_KV_HEADS,
        max_position_embeddings=_MAX_POS,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=False,
    )


# vision tower shape shared by the Qwen2.5-VL and Qwen3-VL tiny configs
_QWEN_VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=_HIDDEN,
    patch_size=_QWEN_PATCH,
    spatial_merge_size=_QWEN_MERGE,
    temporal_patch_size=_QWEN_TEMPORAL_PATCH,
)


def tiny_config(family: str, num_layers: int = 2):
    """The config tiny_model(family) is built from (no weights)."""
    _check_family(family)

    text = _text_kwargs(num_layers)
    if family == "llama":
        return tf.LlamaConfig(**text, head_dim=_HEAD_DIM)
    if family == "qwen2":
        return tf.Qwen2Config(**text)
    if family == "qwen3":
        return tf.Qwen3Config(**text, head_dim=_HEAD_DIM)

    if family in ("qwen2_vl", "qwen2_5_vl"):
        # mrope_section halves of head_dim: 2 + 3 + 3 = 16 / 2
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
        text_cfg = dict(text, rope_parameters=rope)
        if family == "qwen2_vl":
            vision = dict(
                depth=2,
                embed_dim=32,
                hidden_size=_HIDDEN,  # merger output = LM hidden size
                mlp_ratio=2,
                num_heads=2,
                patch_size=_QWEN_PATCH,
                spatial_merge_size=_QWEN_MERGE,
                temporal_patch_size=_QWEN_TEMPORAL_PATCH,
            )
            cls = tf.Qwen2VLConfig
        else:
            vision = dict(
                **_QWEN_VISION,
                window_size=_QWEN_PATCH * _QWEN_MERGE * 2,  # 2x2 merged units per window
                fullatt_block_indexes=[1],
            )
            cls = tf.Qwen2_5_VLConfig
        return cls(
            text_config=text_cfg,
            vision_config=vision,
            image_token_id=QWEN_IMAGE_ID,
            video_token_id=QWEN_VIDEO_ID,
            vision_start_token_id=QWEN_VISION_START_ID,
            vision_end_token_id=QWEN_VISION_END_ID,
            tie_word_embeddings=False,
        )
    if family == "qwen3_vl":
        rope = {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [4, 2, 2],
            "mrope_interleaved": True,
        }
        text_cfg = dict(text, head_dim=_HEAD_DIM, rope_parameters=rope)
        vision = dict(
            **_QWEN_VISION,
            num_position_embeddings=64,  # 8x8 learned grid, interpolated
            deepstack_visual_indexes=[0],  # injected into LM layer 0
        )
        return tf.Qwen3VLConfig(
            text_config=text_cfg,
            vision_config=vision,
            image_token_id=QWEN_IMAGE_ID,
            video_token_id=QWEN_VIDEO_ID,
            vision_start_token_id=QWEN_VISION_START_ID,
            vision_end_token_id=QWEN_VISION_END_ID,
            tie_word_embeddings=False,
        )

    # LLaVA families
    vision_common = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=_LLAVA_IMAGE_SIZE,
        patch_size=_LLAVA_PATCH,
    )
    if family == "llava":
        return tf.LlavaConfig(
            vision_config=tf.CLIPVisionConfig(**vision_common, projection_dim=32),
            text_config=tf.LlamaConfig(**text, head_dim=_HEAD_DIM),
            image_token_index=LLAVA_IMAGE_ID,
            image_seq_length=(_LLAVA_IMAGE_SIZE // _LLAVA_PATCH) ** 2,
            vision_feature_select_strategy="default",
            vision_feature_layer=-2,
        )
    if family == "llava_next":
        return tf.LlavaNextConfig(
            vision_config=tf.CLIPVisionConfig(**vision_common, projection_dim=32),
            text_config=tf.LlamaConfig(**text, head_dim=_HEAD_DIM),
            image_token_index=LLAVA_IMAGE_ID,
            image_seq_length=(_LLAVA_IMAGE_SIZE // _LLAVA_PATCH) ** 2,
            image_grid_pinpoints=[list(p) for p in _LLAVA_PINPOINTS],
            vision_feature_select_strategy="default",
            vision_feature_layer=-2,
        )
    # llava_onevision: SigLIP vision tower (no CLS) + Qwen2 language model
    return tf.LlavaOnevisionConfig(
        vision_config=tf.SiglipVisionConfig(**vision_common, vision_use_head=False),
        text_config=tf.Qwen2Config(**text),
        image_token_index=LLAVA_IMAGE_ID,
        video_token_index=LLAVA_VIDEO_ID,
        image_grid_pinpoints=[list(p) for p in _LLAVA_PINPOINTS],
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        vision_aspect_ratio="anyres_max_9",
    )


def _model_class(family: str):
    return {
        "llama": tf.LlamaForCausalLM,
        "qwen2": tf.Qwen2ForCausalLM,
        "qwen3": tf.Qwen3ForCausalLM,
        "qwen2_vl": tf.Qwen2VLForConditionalGeneration,
        "qwen2_5_vl": tf.Qwen2_5_VLForConditionalGeneration,
        "qwen3_vl": tf.Qwen3VLForConditionalGeneration,
        "llava": tf.LlavaForConditionalGeneration,
        "llava_next": tf.LlavaNextForConditionalGeneration,
        "llava_onevision": tf.LlavaOnevisionForConditionalGeneration,
    }[family]


def tiny_model(family: str, dtype: torch.dtype = torch.float32, seed: int = 0, num_layers: int = 2):
    """A random-weight model of ``family`` in eval mode with sdpa attention.

    LM: hidden 64, 4 query heads, 2 kv heads (GQA), head_dim 16, vocab TINY_VOCAB_SIZE.
    Deterministic given ``seed`` (weights are drawn from torch's global RNG, whose state
    is saved and restored around the construction).
    """
    _check_family(family)
    if num_layers < 1:
        raise ValueError("num_layers must be >= 1")
    config = tiny_config(family, num_layers=num_layers)
    cls = _model_class(family)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls._from_config(config, attn_implementation="sdpa", dtype=dtype)
    model.eval()
    gc = model.generation_config
    gc.pad_token_id = PAD_ID
    gc.bos_token_id = BOS_ID
    gc.eos_token_id = EOS_ID
    return model


# ----------------------------------------------------------------------------- inputs


def _family_of(model) -> str:
    model_type = getattr(model.config, "model_type", None)
    if model_type not in TINY_FAMILIES:
        raise ValueError(f"tiny_inputs: unsupported model_type {model_type!r}")
    return model_type


def _model_device_dtype(model):
    try:
        p = next(model.parameters())
        return p.device, p.dtype
    except StopIteration:  # pragma: no cover
        return torch.device("cpu"), torch.float32


def _qwen_image_block(n_tokens: int) -> list[int]:
    return [QWEN_VISION_START_ID] + [QWEN_IMAGE_ID] * n_tokens + [QWEN_VISION_END_ID]


def _llava_image_token_counts(model, family, pixel_values, image_sizes, batch_num_images) -> list[int]:
    """Number of placeholder tokens per image, asked from the model's own vision path."""
    base = model.model if hasattr(model, "model") else model
    kwargs: dict = {}
    if family == "llava_next":
        kwargs = {"image_sizes": image_sizes}
    elif family == "llava_onevision":
        kwargs = {"image_sizes": image_sizes, "batch_num_images": batch_num_images}
    with torch.no_grad():
        out = base.get_image_features(pixel_values=pixel_values, return_dict=True, **kwargs)
    feats = out.pooler_output
    if isinstance(feats, torch.Tensor) and feats.dim() == 3:  # llava: (num_images, seq, dim)
        return [int(feats.shape[1])] * int(feats.shape[0])
    return [int(f.shape[0]) for f in feats]


def tiny_inputs(
    model,
    batch_size: int = 1,
    num_images: int = 1,
    text_len: int = 12,
    left_pad: int = 0,
    seed: int = 0,
    num_videos: int = 0,
    num_frames: int = 4,
) -> dict:
    """Random inputs ready for ``model(**inputs)`` / ``model.generate(**inputs)``.

    Each row is ``[bos] text_a  <images>  text_b`` where the text tokens are random byte
    tokens (ids >= 16) and ``<images>`` holds ``num_images`` images, each expanded to the
    number of placeholder tokens the model expects:

    * Qwen VL: ``<|vision_start|> <|image_pad|>*n <|vision_end|>``; image i of every row
      uses grid ``_QWEN_GRIDS[i % 4]`` ((1,8,8) -> 16 tokens, (1,4,8) -> 8 tokens, ...).
      Returns ``pixel_values`` (sum(t*h*w), 3*2*4*4), ``image_grid_thw`` and
      ``mm_token_type_ids`` (0 text / 1 image; required by transformers 5.x for M-RoPE).
    * LLaVA: ``<image>*16`` per image; ``pixel_values`` (n_images, 3, 16, 16).
    * LLaVA-NeXT: anyres tiles; image i has original size ``_LLAVA_IMAGE_SIZES[i % 4]``;
      ``pixel_values`` (n_images, max_tiles, 3, 16, 16) and ``image_sizes``.
    * LLaVA-OneVision: like NeXT plus ``batch_num_images``; rows with several images
      use the un-tiled multi-image path (like the real processor).

    Videos (``num_videos`` > 0, ``num_frames`` synthetic frames each; Qwen VL and
    LLaVA-OneVision only) follow the images, in the layout the family's video processor emits
    (video processors need torchvision, so the tensors are drawn here directly):

    * Qwen2-VL / 2.5-VL: one ``<|vision_start|> <|video_pad|>*n <|vision_end|>`` block per
      video, grid ``(num_frames // 2, 4, 4)`` -> 4 tokens per temporal patch;
      ``pixel_values_videos``, ``video_grid_thw``, ``mm_token_type_ids`` 2 on video tokens.
    * Qwen3-VL: the same grid, one block per temporal patch (Qwen3-VL separates frames with
      timestamps; any text between blocks does).
    * LLaVA-OneVision: ``<video>`` * (tokens the model's video path returns: 4 per frame + 1);
      ``pixel_values_videos`` (batch, num_frames, 3, 16, 16).

    Text families ignore ``num_images``. Row 0 has ``text_len`` text tokens; with
    ``left_pad > 0`` row i>0 has ``i * left_pad`` fewer text tokens and is left-padded
    with pad id 0 (attention_mask 0). Deterministic given ``seed``.
    """
    family = _family_of(model)
    if family in _TEXT_FAMILIES:
        num_images = 0
    if batch_size < 1 or num_images < 0 or left_pad < 0:
        raise ValueError("batch_size must be >= 1, num_images and left_pad >= 0")
    pads = [i * left_pad for i in range(batch_size)]
    min_text = text_len - pads[-1]
    if min_text < 2:
        raise ValueError(
            f"text_len={text_len} too short for batch_size={batch_size}, left_pad={left_pad}: "
            f"the last row would keep {min_text} text tokens (need >= 2)"
        )
    device, dtype = _model_device_dtype(model)
    gen = torch.Generator().manual_seed(seed)
    out: dict = {}

    # ---- image side
    image_blocks: list[list[int]] = []  # token block per image index (same in every row)
    n_total = batch_size * num_images
    if family in _QWEN_VL_FAMILIES and num_images > 0:
        grids = [_QWEN_GRIDS[i % len(_QWEN_GRIDS)] for i in range(num_images)]
        merge2 = _merge_size(model) ** 2
        patch_dim = _qwen_patch_dim(model)
        image_blocks = [_qwen_image_block(t * h * w // merge2) for (t, h, w) in grids]
        all_grids = grids * batch_size
        n_patches = sum(t * h * w for (t, h, w) in all_grids)
        out["pixel_values"] = torch.randn(n_patches, patch_dim, generator=gen).to(device, dtype)
        out["image_grid_thw"] = torch.tensor(all_grids, dtype=torch.long, device=device)
    elif family in _LLAVA_FAMILIES and num_images > 0:
        vcfg = model.config.vision_config
        size = vcfg.image_size
        image_sizes = None
        batch_num_images = None
        if family == "llava":
            pixel_values = torch.randn(n_total, 3, size, size, generator=gen)
        else:
            sizes = [_LLAVA_IMAGE_SIZES[i % len(_LLAVA_IMAGE_SIZES)] for i in range(num_images)] * batch_size
            tiles = [
                image_size_to_num_patches(list(s), model.config.image_grid_pinpoints, size) for s in sizes
            ]
            if family == "llava_onevision" and num_images > 1:
                tiles = [1] * len(sizes)  # multi-image rows are not tiled
            pixel_values = torch.randn(n_total, max(tiles), 3, size, size, generator=gen)
            image_sizes = torch.tensor(sizes, dtype=torch.long)
            out["image_sizes"] = image_sizes.to(device)
            if family == "llava_onevision":
                batch_num_images = torch.tensor([num_images] * batch_size, dtype=torch.long)
                out["batch_num_images"] = batch_num_images.to(device)
        pixel_values = pixel_values.to(device, dtype)
        out["pixel_values"] = pixel_values
        counts = _llava_image_token_counts(
            model,
            family,
            pixel_values,
            None if image_sizes is None else image_sizes.to(device),
            None if batch_num_images is None else batch_num_images.to(device),
        )
        # same sizes in every row -> take the first row's counts
        image_blocks = [[LLAVA_IMAGE_ID] * c for c in counts[:num_images]]

    # ---- video side
    video_blocks: list[int] = []
    if num_videos:
        video_blocks = _tiny_videos(model, family, out, batch_size, num_videos, num_frames, gen, device, dtype)

    # ---- token side
    rows: list[list[int]] = []
    for i in range(batch_size):
        n_text = text_len - pads[i]
        text = torch.randint(_NUM_SPECIAL, TINY_VOCAB_SIZE, (n_text,), generator=gen).tolist()
        n_a = max(1, n_text // 3)
        row = [BOS_ID] + text[:n_a] + list(itertools.chain.from_iterable(image_blocks)) + video_blocks + text[n_a:]
        rows.append(row)
    max_len = max(len(r) for r in rows)
    input_ids = torch.full((batch_size, max_len), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros((batch_size, max_len), dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, max_len - len(r) :] = torch.tensor(r, dtype=torch.long)
        attention_mask[i, max_len - len(r) :] = 1
    out = {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device), **out}
    if family in _QWEN_VL_FAMILIES:
        mm = torch.zeros_like(input_ids)
        mm[input_ids == QWEN_IMAGE_ID] = 1
        mm[input_ids == QWEN_VIDEO_ID] = 2
        out["mm_token_type_ids"] = mm.to(device)
    return out


_QWEN_VIDEO_HW = (4, 4)  # patches per frame of the tiny videos -> 4 tokens after the 2x2 merge


def _tiny_videos(model, family, out, batch_size, num_videos, num_frames, gen, device, dtype) -> list[int]:
    """Adds the video tensors of ``num_videos`` synthetic videos per row to ``out``; returns the
    placeholder tokens of one row's videos."""
    if num_videos < 0 or num_frames < 1:
        raise ValueError("num_videos must be >= 0 and num_frames >= 1")
    if family in _QWEN_VL_FAMILIES:
        tp = int(model.config.vision_config.temporal_patch_size)
        if num_frames % tp:
            raise ValueError(f"num_frames must be a multiple of the temporal patch size {tp}, got {num_frames}")
        t, (h, w) = num_frames // tp, _QWEN_VIDEO_HW
        per_step = h * w // _merge_size(model) ** 2
        out["pixel_values_videos"] = torch.randn(batch_size * num_videos * t * h * w, _qwen_patch_dim(model),
                                                 generator=gen).to(device, dtype)
        out["video_grid_thw"] = torch.tensor([[t, h, w]] * (batch_size * num_videos), dtype=torch.long,
                                             device=device)
        if family == "qwen3_vl":
            block = ([QWEN_VISION_START_ID] + [QWEN_VIDEO_ID] * per_step + [QWEN_VISION_END_ID]) * t
        else:
            block = [QWEN_VISION_START_ID] + [QWEN_VIDEO_ID] * (per_step * t) + [QWEN_VISION_END_ID]
        return block * num_videos
    if family == "llava_onevision":
        if num_videos != 1:
            raise ValueError("tiny LLaVA-OneVision inputs hold at most one video per row")
        size = model.config.vision_config.image_size
        pixels = torch.randn(batch_size, num_frames, 3, size, size, generator=gen).to(device, dtype)
        out["pixel_values_videos"] = pixels
        base = model.model if hasattr(model, "model") else model
        with torch.no_grad():
            feats = base.get_video_features(pixel_values_videos=pixels[:1], return_dict=True).pooler_output
        return [LLAVA_VIDEO_ID] * int(feats.shape[1])
    raise ValueError(f"tiny video inputs exist for the Qwen VL families and llava_onevision, not {family!r}")


def _merge_size(model) -> int:
    return int(model.config.vision_config.spatial_merge_size)


def _qwen_patch_dim(model) -> int:
    v = model.config.vision_config
    return int(v.in_channels * v.temporal_patch_size * v.patch_size * v.patch_size)


# ----------------------------------------------------------------------------- processors


_QWEN_SPECIALS = (
    "<|endoftext|>",  # 0 pad
    "<|bos|>",  # 1 bos (Qwen adds none; kept for the shared id layout)
    "<|eos|>",  # 2 eos (the model's eos_token_id)
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
_LLAVA_SPECIALS = ("<pad>", "<s>", "</s>", "<image>", "<video>")

# Qwen2-VL style ChatML template (images / videos become vision_start pad vision_end).
_QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# llava-hf style "USER: <image>\n text ASSISTANT:" template.
_LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}"
    "{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}{{ '<video>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' ' }}{% endfor %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def _is_qwen(family: str) -> bool:
    return family.startswith("qwen")


def tiny_tokenizer(family: str):
    """A byte-level BPE tokenizer (no merges) over the tiny vocabulary, with the family's
    special tokens at ids 0..15 and a chat template. Every id < TINY_VOCAB_SIZE decodes."""
    _check_family(family)

    specials = list(_QWEN_SPECIALS if _is_qwen(family) else _LLAVA_SPECIALS)
    specials += [f"<|reserved_{i}|>" for i in range(len(specials), _NUM_SPECIAL)]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet())):
        vocab[ch] = _NUM_SPECIAL + i
    assert len(vocab) == TINY_VOCAB_SIZE

    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    if not _is_qwen(family):  # llama-style: prepend <s>
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)

    if _is_qwen(family):
        kwargs = dict(pad_token="<|endoftext|>", bos_token="<|bos|>", eos_token="<|eos|>")
        template = _QWEN_CHAT_TEMPLATE
    else:
        kwargs = dict(pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token=None)
        template = _LLAVA_CHAT_TEMPLATE
        if family in _TEXT_FAMILIES:
            # tokenizer.apply_chat_template does not add special tokens; processors do.
            template = "{{ bos_token }}" + template
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, padding_side="left", **kwargs)
    hf.chat_template = template
    return hf


def _without_video(cls):
    return without_video_processor(cls)


def tiny_processor(family: str):
    """A real transformers processor whose ids match ``tiny_model(family)``.

    * qwen2_vl / qwen2_5_vl / qwen3_vl: Qwen{2,2_5,3}VLProcessor over Qwen2VLImageProcessorPil
      (patch 4, temporal patch 2, merge 2; images resized to 16..1024 pixels, i.e. at most
      8x8 patches = 16 image tokens). No video processor (needs torchvision).
    * llava: LlavaProcessor over CLIPImageProcessorPil (16x16 crop -> 16 image tokens).
    * llava_next: LlavaNextProcessor over LlavaNextImageProcessorPil (anyres, tiny pinpoints).
    * llava_onevision: LlavaOnevisionProcessor over LlavaOnevisionImageProcessorPil.
    * text families: the tokenizer itself (it has a chat template).

    Use ``processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
    return_dict=True, return_tensors="pt")`` with {"type": "image", "image": PIL.Image} items.
    Tokenizer pads on the left.
    """
    _check_family(family)

    tokenizer = tiny_tokenizer(family)
    if family in _TEXT_FAMILIES:
        return tokenizer
    template = tokenizer.chat_template
    if family in _QWEN_VL_FAMILIES:
        factor = _QWEN_PATCH * _QWEN_MERGE
        image_processor = tf.Qwen2VLImageProcessorPil(
            patch_size=_QWEN_PATCH,
            temporal_patch_size=_QWEN_TEMPORAL_PATCH,
            merge_size=_QWEN_MERGE,
            min_pixels=(2 * factor) ** 2,
            max_pixels=(4 * factor) ** 2,
        )
        cls = {
            "qwen2_vl": tf.Qwen2VLProcessor,
            "qwen2_5_vl": tf.Qwen2_5_VLProcessor,
            "qwen3_vl": tf.Qwen3VLProcessor,
        }[family]
        return _without_video(cls)(image_processor=image_processor, tokenizer=tokenizer, chat_template=template)
    side = _LLAVA_IMAGE_SIZE
    if family == "llava":
        image_processor = tf.CLIPImageProcessorPil(
            size={"shortest_edge": side}, crop_size={"height": side, "width": side}
        )
        return tf.LlavaProcessor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            patch_size=_LLAVA_PATCH,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,  # CLIP CLS
            chat_template=template,
        )
    if family == "llava_next":
        image_processor = tf.LlavaNextImageProcessorPil(
            size={"shortest_edge": side},
            crop_size={"height": side, "width": side},
            image_grid_pinpoints=[list(p) for p in _LLAVA_PINPOINTS],
        )
        return tf.LlavaNextProcessor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            patch_size=_LLAVA_PATCH,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
            chat_template=template,
        )
    image_processor = tf.LlavaOnevisionImageProcessorPil(
        size={"height": side, "width": side},
        image_grid_pinpoints=[list(p) for p in _LLAVA_PINPOINTS],
    )
    return _without_video(tf.LlavaOnevisionProcessor)(
        image_processor=image_processor,
        tokenizer=tokenizer,
        num_image_tokens=(side // _LLAVA_PATCH) ** 2,
        vision_feature_select_strategy="full",
        vision_aspect_ratio="anyres_max_9",
        chat_template=template,
    )


def tiny_gates(model, kind: str = "dbtrimkv", seed: int = 0, width: int = 16, coupled: bool = True):
    """Random-weight retention gates that fit ``model``, with rates spread so eviction has choices."""

    adapter = get_adapter(model)
    torch.manual_seed(seed)
    gates = RetentionGates(GateConfig(kind=kind, hidden_size=adapter.hidden_size, num_layers=adapter.num_layers,
                                      num_kv_heads=adapter.num_kv_heads, width=width, init_bias=1.0,
                                      coupled=coupled, model=adapter.fingerprint()))
    for p in gates.parameters():
        torch.nn.init.normal_(p, std=1.0)
    return gates

def save_tiny_vlm(family: str, folder, seed: int = 0) -> str:
    """Save ``tiny_model(family)`` and ``tiny_processor(family)`` to ``folder`` like a checkpoint
    (the stock processor class name, so ``vlm_kv.models.loading.load_vlm`` / AutoProcessor find it).
    Families whose tiny processor has no video processor (Qwen VL, OneVision: video processors
    need torchvision) are marked image-only (``vlm_kv.models.loading.IMAGE_ONLY_MARKER``), so loading
    the folder gives that processor without a warning."""

    if family in _TEXT_FAMILIES:
        raise ValueError(f"save_tiny_vlm: {family!r} is a text family")
    folder = str(folder)
    tiny_model(family, seed=seed).save_pretrained(folder)
    processor = tiny_processor(family)
    processor.save_pretrained(folder)
    cfg_path = os.path.join(folder, "processor_config.json")
    with open(cfg_path, encoding="utf-8") as fh:
        cfg = json.load(fh)
    cls = type(processor)
    stock = cls.__mro__[1] if cls.__name__.endswith("WithoutVideo") else cls  # the class a checkpoint names
    cfg["processor_class"] = stock.__name__
    with open(cfg_path, "w", encoding="utf-8") as fh:
        json.dump(cfg, fh, indent=2)
    if stock is not cls:  # saved without its video processor: say it is image-only on purpose
        with open(os.path.join(folder, IMAGE_ONLY_MARKER), "w", encoding="utf-8") as fh:
            fh.write("{}\n")
    return folder


def record_evictions(cache) -> list[tuple[int, int]]:
    """Wrap ``cache.evict`` so that every eviction step appends (key/value bytes held, bytes the
    budget allows) to the returned list: what the budget tests check after each step."""
    steps: list[tuple[int, int]] = []
    evict = cache.evict

    def recording_evict() -> None:
        evict()
        steps.append((cache.kv_bytes()["total"], cache.budget_bytes()))

    cache.evict = recording_evict
    return steps


@contextlib.contextmanager
def attention_fails_at_call(model, call: int, message: str = "boom"):
    """Within the block, the ``call``-th attention forward of ``model``'s decoder layers (counted
    from 1 over every layer and forward) raises ``RuntimeError(message)``: how the tests check that
    a call failing half-way leaves the cache as it was."""
    calls = []

    def count(*args) -> None:
        calls.append(1)
        if len(calls) == call:
            raise RuntimeError(message)

    layers = model.model.language_model.layers if hasattr(model.model, "language_model") else model.model.layers
    handles = [layer.self_attn.register_forward_pre_hook(count) for layer in layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def random_tokens(n: int, batch: int = 1, seed: int = 0, vocab: int = 256) -> torch.Tensor:
    """[batch, n] token ids in [5, vocab), reproducible from ``seed``."""
    return torch.randint(5, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


def feed_tokens(model, cache, tokens: torch.Tensor, prefill: int) -> torch.Tensor:
    """Prefill ``tokens[:, :prefill]`` into ``cache``, then feed the rest one token per forward, as
    ``generate`` does; returns the logits of every position [B, T, V]."""
    outs = []
    with torch.no_grad():
        outs.append(model(input_ids=tokens[:, :prefill], past_key_values=cache, use_cache=True).logits)
        for i in range(prefill, tokens.shape[1]):
            outs.append(model(input_ids=tokens[:, i : i + 1], past_key_values=cache, use_cache=True).logits)
    return torch.cat(outs, dim=1)


def route_with_forced_decision(cache, key: tuple[int, int], decision_of_window: int) -> None:
    """Run one routing event of a tiered ``cache`` in which window ``key`` = (row, window id) of
    layer 0 gets ``decision_of_window`` (FP, INT2 or EVICT) and every other window what the policy
    decides: how the tier tests drive a window through demotion and promotion."""
    router = cache.router
    decide = router._decide

    def patched(layers, routings, allocation, scorer):
        decisions, fallback = decide(layers, routings, allocation, scorer)
        H = decisions[0].shape[1]
        decisions[0][key[0] // H, key[0] % H, key[1]] = decision_of_window
        return decisions, fallback

    router._decide = patched
    try:
        cache.evict()
    finally:
        router._decide = decide
