"""Tests for vlm_kv.testing: tiny models, inputs and processors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from vlm_kv.models.adapters import get_adapter
from vlm_kv.testing import (
    TINY_FAMILIES,
    TINY_VOCAB_SIZE,
    tiny_inputs,
    tiny_model,
    tiny_processor,
)

TEXT_FAMILIES = ("llama", "qwen2", "qwen3")
VLM_FAMILIES = tuple(f for f in TINY_FAMILIES if f not in TEXT_FAMILIES)
QWEN_VL = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")

_MODELS: dict = {}


def _model(family: str, dtype: torch.dtype = torch.float32):
    key = (family, dtype)
    if key not in _MODELS:
        _MODELS[key] = tiny_model(family, dtype=dtype)
    return _MODELS[key]


def _generate(model, inputs, n=4):
    with torch.no_grad():
        return model.generate(**inputs, max_new_tokens=n, do_sample=False)


# ----------------------------------------------------------------------------- models


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tiny_model_properties(family):
    m = _model(family)
    assert m.config.model_type == family
    assert not m.training
    assert m.config._attn_implementation == "sdpa"
    a = get_adapter(m)
    assert (a.hidden_size, a.num_attention_heads, a.num_kv_heads, a.head_dim) == (64, 4, 2, 16)
    assert a.num_layers == 2
    assert a.vocab_size == TINY_VOCAB_SIZE
    assert all(p.dtype == torch.float32 for p in m.parameters())
    n_params = sum(p.numel() for p in m.parameters())
    assert n_params < 500_000


@pytest.mark.parametrize("family", ["llama", "qwen2_5_vl", "llava_next"])
def test_tiny_model_dtype_seed_layers(family):
    a = tiny_model(family, seed=1)
    b = tiny_model(family, seed=1)
    c = tiny_model(family, seed=2)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    bf = tiny_model(family, dtype=torch.bfloat16, num_layers=3)
    assert all(p.dtype == torch.bfloat16 for p in bf.parameters())
    assert get_adapter(bf).num_layers == 3
    assert not bf.training


def test_tiny_model_unknown_family():
    with pytest.raises(ValueError, match="gpt2"):
        tiny_model("gpt2")


# ----------------------------------------------------------------------------- inputs


@pytest.mark.parametrize("family", QWEN_VL)
def test_qwen_inputs_layout(family):
    m = _model(family)
    inp = tiny_inputs(m, batch_size=2, num_images=2)
    thw = inp["image_grid_thw"]
    assert thw.tolist() == [[1, 8, 8], [1, 4, 8], [1, 8, 8], [1, 4, 8]]
    assert inp["pixel_values"].shape == (int(thw.prod(-1).sum()), 3 * 2 * 4 * 4)
    ids = inp["input_ids"]
    img_id = m.config.image_token_id
    # 64/4 + 32/4 placeholder tokens per row, each image wrapped in vision start/end
    assert (ids == img_id).sum(1).tolist() == [24, 24]
    assert (ids == m.config.vision_start_token_id).sum(1).tolist() == [2, 2]
    assert (ids == m.config.vision_end_token_id).sum(1).tolist() == [2, 2]
    assert torch.equal(inp["mm_token_type_ids"], (ids == img_id).long())


@pytest.mark.parametrize("family", ["llava", "llava_next", "llava_onevision"])
def test_llava_inputs_layout(family):
    m = _model(family)
    img_id = m.config.image_token_id
    one = tiny_inputs(m, batch_size=1, num_images=1)
    two = tiny_inputs(m, batch_size=1, num_images=2)
    n1 = int((one["input_ids"] == img_id).sum())
    n2 = int((two["input_ids"] == img_id).sum())
    if family == "llava":
        assert one["pixel_values"].shape == (1, 3, 16, 16)
        assert (n1, n2) == (16, 32)
    else:
        assert one["pixel_values"].dim() == 5 and one["image_sizes"].shape == (1, 2)
        assert two["image_sizes"].tolist() == [[16, 16], [16, 32]]
    if family == "llava_next":
        # anyres, worked by hand: (16,16) -> best pinpoint 16x32 -> 16 base + 4x4 unpadded
        # + 4 newlines = 36; (16,32) -> 16 base + 4x8 + 4 newlines = 52
        assert (n1, n2) == (36, 36 + 52)
    if family == "llava_onevision":
        assert n1 == 36  # single image: anyres like NeXT (SigLIP, no CLS)
        assert two["batch_num_images"].tolist() == [2]
        assert n2 == 2 * (16 + 1)  # multi-image rows: base tile + newline per image


@pytest.mark.parametrize("family", ["llama", "qwen2_vl", "llava"])
def test_inputs_left_padding_and_determinism(family):
    m = _model(family)
    n_img = 0 if family in TEXT_FAMILIES else 1
    inp = tiny_inputs(m, batch_size=3, num_images=n_img, text_len=12, left_pad=2, seed=5)
    mask, ids = inp["attention_mask"], inp["input_ids"]
    assert mask.shape == ids.shape
    assert (mask == 0).sum(1).tolist() == [0, 2, 4]
    assert bool((ids[mask == 0] == 0).all())
    assert bool((mask[:, -1] == 1).all())
    # rows keep their real tokens contiguous at the right
    for row in range(3):
        pads = int((mask[row] == 0).sum())
        assert bool((mask[row, pads:] == 1).all())
    again = tiny_inputs(m, batch_size=3, num_images=n_img, text_len=12, left_pad=2, seed=5)
    other = tiny_inputs(m, batch_size=3, num_images=n_img, text_len=12, left_pad=2, seed=6)
    assert all(torch.equal(inp[k], again[k]) for k in inp)
    assert not torch.equal(inp["input_ids"], other["input_ids"])
    with pytest.raises(ValueError):
        tiny_inputs(m, batch_size=3, text_len=4, left_pad=2)


@pytest.mark.parametrize("family", TEXT_FAMILIES)
def test_text_inputs_ignore_images(family):
    m = _model(family)
    inp = tiny_inputs(m, batch_size=2, num_images=2, text_len=10)
    assert set(inp) == {"input_ids", "attention_mask"}
    assert inp["input_ids"].shape == (2, 11)  # bos + text


# ----------------------------------------------------------------------------- generate


@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_generate_batched_left_padded(family, dtype):
    m = _model(family, dtype)
    n_img = 0 if family in TEXT_FAMILIES else 2
    inp = tiny_inputs(m, batch_size=2, num_images=n_img, left_pad=3)
    if "pixel_values" in inp:
        assert inp["pixel_values"].dtype == dtype
    out = _generate(m, inp)
    assert out.shape == (2, inp["input_ids"].shape[1] + 4)
    assert torch.equal(out[:, : inp["input_ids"].shape[1]], inp["input_ids"])
    assert int(out.max()) < TINY_VOCAB_SIZE


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_generate_single_image(family):
    m = _model(family)
    inp = tiny_inputs(m, batch_size=1, num_images=1)
    out = _generate(m, inp)
    assert out.shape == (1, inp["input_ids"].shape[1] + 4)


@pytest.mark.parametrize("family", ["llama", "qwen2_5_vl", "qwen3_vl", "llava_next"])
def test_padded_row_matches_unpadded_run(family):
    """Left padding is inert: a padded row gives the same last logits as the row alone."""
    m = _model(family)
    n_img = 0 if family in TEXT_FAMILIES else 2
    inp = tiny_inputs(m, batch_size=2, num_images=n_img, left_pad=3)
    keep = inp["attention_mask"][1].bool()
    single = {k: inp[k][1:, keep] for k in ("input_ids", "attention_mask", "mm_token_type_ids") if k in inp}
    if "image_grid_thw" in inp:
        g = inp["image_grid_thw"]
        n = int(g[:n_img].prod(-1).sum())
        single["pixel_values"] = inp["pixel_values"][n:]
        single["image_grid_thw"] = g[n_img:]
    elif "pixel_values" in inp:
        single["pixel_values"] = inp["pixel_values"][n_img:]
        single["image_sizes"] = inp["image_sizes"][n_img:]
    with torch.no_grad():
        batched = m(**inp).logits[1, -1]
        alone = m(**single).logits[0, -1]
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava"])
def test_pixels_reach_the_language_model(family):
    m = _model(family)
    inp = tiny_inputs(m, num_images=1)
    with torch.no_grad():
        a = m(**inp).logits[0, -1]
        inp2 = dict(inp, pixel_values=inp["pixel_values"] + 1.0)
        b = m(**inp2).logits[0, -1]
    assert not torch.allclose(a, b)


# ----------------------------------------------------------------------------- processors


def _image(h, w, seed):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_processor_chat_template_generate_decode(family):
    proc = tiny_processor(family)
    m = _model(family)
    tok = proc.tokenizer
    assert len(tok) == TINY_VOCAB_SIZE <= m.config.get_text_config().vocab_size
    assert proc.image_token_id == m.config.image_token_id
    assert tok.pad_token_id == 0
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": _image(30, 40, 0)},
                {"type": "text", "text": "What is in the picture?"},
            ],
        }
    ]
    inp = proc.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    assert int((inp["input_ids"] == m.config.image_token_id).sum()) > 0
    out = m.generate(**inp, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, inp["input_ids"].shape[1] + 5)
    texts = proc.batch_decode(out[:, inp["input_ids"].shape[1] :], skip_special_tokens=True)
    assert isinstance(texts, list) and len(texts) == 1 and isinstance(texts[0], str)
    prompt = proc.batch_decode(inp["input_ids"])[0]
    assert "What is in the picture?" in prompt


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava"])
def test_processor_batch_with_padding(family):
    proc = tiny_processor(family)
    m = _model(family)
    convs = [
        [{"role": "user", "content": [{"type": "image", "image": _image(30, 40, 1)}, {"type": "text", "text": "Hi"}]}],
        [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": _image(16, 16, 2)},
                    {"type": "image", "image": _image(64, 20, 3)},
                    {"type": "text", "text": "Compare the two images, please."},
                ],
            }
        ],
    ]
    inp = proc.apply_chat_template(
        convs,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        processor_kwargs={"padding": True},
    )
    mask = inp["attention_mask"]
    assert mask.shape[0] == 2 and int((mask == 0).sum()) > 0
    assert bool((mask[:, -1] == 1).all())  # left padded
    out = m.generate(**inp, max_new_tokens=5, do_sample=False)
    assert len(proc.batch_decode(out, skip_special_tokens=True)) == 2


def test_qwen_processor_token_ids_match_model():
    proc = tiny_processor("qwen2_5_vl")
    cfg = _model("qwen2_5_vl").config
    tok = proc.tokenizer
    assert tok.convert_tokens_to_ids("<|image_pad|>") == cfg.image_token_id
    assert tok.convert_tokens_to_ids("<|video_pad|>") == cfg.video_token_id
    assert tok.convert_tokens_to_ids("<|vision_start|>") == cfg.vision_start_token_id
    assert tok.convert_tokens_to_ids("<|vision_end|>") == cfg.vision_end_token_id
    text = "héllo wörld, 123 😀"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


@pytest.mark.parametrize("family", TEXT_FAMILIES)
def test_text_family_processor_is_tokenizer_with_template(family):
    tok = tiny_processor(family)
    m = _model(family)
    inp = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )
    out = m.generate(**inp, max_new_tokens=3, do_sample=False)
    assert "hello" in tok.batch_decode(out)[0]
