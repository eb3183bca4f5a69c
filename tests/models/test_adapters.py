"""Tests for vlm_kv.models.adapters."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers as tf

from vlm_kv.models.adapters import (
    MODALITIES,
    SUPPORTED_FAMILIES,
    ModelAdapter,
    UnsupportedModelError,
    get_adapter,
)
from vlm_kv.testing import TINY_FAMILIES, tiny_config, tiny_inputs, tiny_model

TEXT_FAMILIES = ("llama", "qwen2", "qwen3")
VLM_FAMILIES = tuple(f for f in SUPPORTED_FAMILIES if f not in TEXT_FAMILIES)
QWEN_VL = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")

_MODELS: dict = {}


def _model(family: str, num_layers: int = 2):
    key = (family, num_layers)
    if key not in _MODELS:
        _MODELS[key] = tiny_model(family, num_layers=num_layers)
    return _MODELS[key]


def test_public_constants():
    assert MODALITIES == ("text", "image", "video")
    assert SUPPORTED_FAMILIES == (
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
    assert set(TINY_FAMILIES) == set(SUPPORTED_FAMILIES)


# ----------------------------------------------------------------------------- numbers


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_numbers_match_tiny_config(family):
    config = tiny_config(family, num_layers=3)
    text = config.get_text_config()
    a = get_adapter(config)
    assert a.family == family
    assert a.num_layers == text.num_hidden_layers == 3
    assert a.num_attention_heads == text.num_attention_heads == 4
    assert a.num_kv_heads == text.num_key_value_heads == 2
    assert a.head_dim == 16
    assert a.hidden_size == text.hidden_size == 64
    assert a.vocab_size == text.vocab_size
    assert a.uses_mrope == (family in QWEN_VL)
    if family in TEXT_FAMILIES:
        assert a.text_config_key is None
        assert a.image_token_id is None and a.video_token_id is None
    else:
        assert a.text_config_key == "text_config"
        assert getattr(config, a.text_config_key) is text
        assert a.image_token_id == config.image_token_id
    if family in QWEN_VL or family == "llava_onevision":
        assert a.video_token_id == config.video_token_id
    elif family in ("llava", "llava_next"):
        assert a.video_token_id is None


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_adapter_from_model_equals_adapter_from_config(family):
    m = _model(family)
    assert get_adapter(m) == get_adapter(m.config) == get_adapter(tiny_config(family))
    # the attention modules agree with the adapter's geometry
    attn = get_adapter(m).attention_modules(m)[0]
    assert attn.k_proj.out_features == 2 * 16
    assert attn.q_proj.out_features == 4 * 16


@pytest.mark.parametrize(
    "config, expected",
    [
        # real-size default configs (no weights built)
        (tf.Qwen2_5_VLConfig(), dict(num_layers=80, heads=64, kv=8, head_dim=128, hidden=8192, image=151655, video=151656)),
        (tf.Qwen2VLConfig(), dict(num_layers=80, heads=64, kv=8, head_dim=128, hidden=8192, image=151655, video=151656)),
        (tf.Qwen3VLConfig(), dict(num_layers=32, heads=32, kv=32, head_dim=128, hidden=4096, image=151655, video=151656)),
        (tf.LlavaConfig(), dict(num_layers=32, heads=32, kv=32, head_dim=128, hidden=4096, image=32000, video=None)),
        (tf.LlavaNextConfig(), dict(num_layers=32, heads=32, kv=32, head_dim=128, hidden=4096, image=32000, video=None)),
        (
            tf.LlavaOnevisionConfig(),
            # default text config is a stock Qwen2Config
            dict(num_layers=32, heads=32, kv=32, head_dim=128, hidden=4096, image=151646, video=151647),
        ),
    ],
    ids=lambda x: getattr(x, "model_type", ""),
)
def test_default_vlm_configs(config, expected):
    a = get_adapter(config)
    assert a.num_layers == expected["num_layers"]
    assert a.num_attention_heads == expected["heads"]
    assert a.num_kv_heads == expected["kv"]
    assert a.head_dim == expected["head_dim"]
    assert a.hidden_size == expected["hidden"]
    assert a.image_token_id == expected["image"]
    assert a.video_token_id == expected["video"]


def test_llava_token_index_naming():
    a = get_adapter(tf.LlavaConfig(image_token_index=7))
    assert a.image_token_id == 7
    b = get_adapter(tf.LlavaOnevisionConfig(image_token_index=9, video_token_index=11))
    assert (b.image_token_id, b.video_token_id) == (9, 11)


def test_missing_head_dim_and_kv_heads_are_derived():
    # Qwen2Config has no head_dim; num_key_value_heads=None means MHA
    cfg = tf.Qwen2Config(hidden_size=96, num_attention_heads=6, num_key_value_heads=None, num_hidden_layers=1)
    a = get_adapter(cfg)
    assert a.head_dim == 16
    assert a.num_kv_heads == 6
    # an explicit head_dim that differs from hidden/heads wins
    cfg3 = tf.Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    assert get_adapter(cfg3).head_dim == 32
    # text config without head_dim inside a VLM
    llava = tf.LlavaConfig(text_config=tf.Qwen2Config(hidden_size=96, num_attention_heads=3, num_key_value_heads=1))
    a = get_adapter(llava)
    assert (a.head_dim, a.num_kv_heads, a.num_attention_heads) == (32, 1, 3)


def test_adapter_is_frozen():
    a = get_adapter(tiny_config("llama"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.num_layers = 5
    assert isinstance(a, ModelAdapter)


# ----------------------------------------------------------------------------- modality


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_modality_of_marks_exactly_placeholder_positions(family):
    a = get_adapter(tiny_config(family))
    img, vid = a.image_token_id, a.video_token_id
    ids = torch.randint(16, 200, (3, 20))
    ids[0, 2:6] = img
    ids[1, 10] = img
    ids[2, 0] = img
    expected = torch.zeros(3, 20, dtype=torch.uint8)
    expected[0, 2:6] = 1
    expected[1, 10] = 1
    expected[2, 0] = 1
    if vid is not None:
        ids[1, 12:15] = vid
        expected[1, 12:15] = 2
    mod = a.modality_of(ids)
    assert mod.dtype == torch.uint8
    assert mod.shape == ids.shape
    assert torch.equal(mod, expected)
    # 1-D input, list input
    assert torch.equal(a.modality_of(ids[0]), expected[0])
    assert torch.equal(a.modality_of(ids[0].tolist()), expected[0])


@pytest.mark.parametrize("family", TEXT_FAMILIES)
def test_modality_of_text_family_is_all_text(family):
    a = get_adapter(tiny_config(family))
    ids = torch.arange(0, 272).view(2, -1)
    mod = a.modality_of(ids)
    assert mod.dtype == torch.uint8 and mod.shape == ids.shape
    assert int(mod.sum()) == 0


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_modality_of_on_tiny_inputs(family):
    m = _model(family)
    a = get_adapter(m)
    inp = tiny_inputs(m, batch_size=2, num_images=2, left_pad=2)
    mod = a.modality_of(inp["input_ids"])
    assert torch.equal(mod.bool(), inp["input_ids"] == a.image_token_id)
    assert int((mod == 2).sum()) == 0
    assert int((mod == 1).sum()) > 0
    if family in QWEN_VL:
        # same convention as the processor's mm_token_type_ids
        assert torch.equal(mod.long(), inp["mm_token_type_ids"].long())


# ----------------------------------------------------------------------------- modules


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
@pytest.mark.parametrize("num_layers", [2, 3])
def test_attention_modules(family, num_layers):
    m = _model(family, num_layers)
    a = get_adapter(m)
    mods = a.attention_modules(m)
    assert len(mods) == a.num_layers == num_layers
    assert [mod.layer_idx for mod in mods] == list(range(num_layers))
    assert len({id(mod) for mod in mods}) == num_layers
    # they belong to the language model, not the vision tower
    lm = m.model.language_model if family in VLM_FAMILIES else m.model
    lm_modules = {id(x) for x in lm.modules()}
    assert all(id(mod) in lm_modules for mod in mods)
    assert all(hasattr(mod, "k_proj") and hasattr(mod, "v_proj") for mod in mods)
    # also reachable from the base model and the bare language model
    assert [id(x) for x in a.attention_modules(m.model)] == [id(x) for x in mods]
    assert [id(x) for x in a.attention_modules(lm)] == [id(x) for x in mods]


def test_attention_modules_layer_count_mismatch_raises():
    a3 = get_adapter(tiny_config("qwen2_5_vl", num_layers=3))
    with pytest.raises(ValueError, match="decoder layers"):
        a3.attention_modules(_model("qwen2_5_vl", 2))


# ----------------------------------------------------------------------------- fingerprint

_FP_KEYS = {
    "family",
    "architecture",
    "num_layers",
    "num_attention_heads",
    "num_kv_heads",
    "head_dim",
    "hidden_size",
    "config_hash",
}


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_fingerprint_shape_and_stability(family):
    m = _model(family)
    fp = get_adapter(m).fingerprint()
    assert set(fp) == _FP_KEYS
    json.dumps(fp)  # serialisable
    assert fp["family"] == family
    assert fp["architecture"] == type(m).__name__
    assert isinstance(fp["config_hash"], str) and len(fp["config_hash"]) == 16
    int(fp["config_hash"], 16)
    # stable: repeated calls, config vs model, dtype and weights do not matter
    assert get_adapter(m).fingerprint() == fp
    assert get_adapter(m.config).fingerprint() == fp
    assert get_adapter(tiny_config(family)).fingerprint() == fp
    other = tiny_model(family, dtype=torch.bfloat16, seed=123)
    assert get_adapter(other).fingerprint() == fp


def test_fingerprint_differs_between_families_and_structures():
    fps = {f: get_adapter(tiny_config(f)).fingerprint() for f in SUPPORTED_FAMILIES}
    assert len({json.dumps(fp, sort_keys=True) for fp in fps.values()}) == len(SUPPORTED_FAMILIES)
    assert fps["llama"] != fps["qwen2"]
    assert fps["qwen2_5_vl"] != fps["qwen2_vl"]
    # structure changes change the hash
    base = get_adapter(tiny_config("llama")).fingerprint()
    deeper = get_adapter(tiny_config("llama", num_layers=3)).fingerprint()
    assert base["config_hash"] != deeper["config_hash"]
    bigger_vocab = get_adapter(tf.LlamaConfig(**{**tiny_config("llama").to_dict(), "vocab_size": 999}))
    assert bigger_vocab.fingerprint()["config_hash"] != base["config_hash"]
    assert get_adapter(tf.Qwen2_5_VLConfig()).fingerprint() != get_adapter(tf.Qwen2VLConfig()).fingerprint()


# ----------------------------------------------------------------------------- unsupported


def _assert_unsupported_message(err: UnsupportedModelError, model_type: str):
    msg = str(err)
    assert model_type in msg
    for family in SUPPORTED_FAMILIES:
        assert family in msg


def test_unsupported_gpt2_model_raises():
    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=32))
    with pytest.raises(UnsupportedModelError) as ei:
        get_adapter(model)
    _assert_unsupported_message(ei.value, "gpt2")
    assert isinstance(ei.value, ValueError)


def test_unsupported_bert_config_raises():
    cfg = tf.BertConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=50
    )
    with pytest.raises(UnsupportedModelError) as ei:
        get_adapter(cfg)
    _assert_unsupported_message(ei.value, "bert")
    with pytest.raises(ValueError):
        get_adapter(tf.BertModel(cfg))


def test_unsupported_sub_config_and_plain_module():
    # the text sub-config of a VLM is not itself a supported family
    with pytest.raises(UnsupportedModelError):
        get_adapter(tiny_config("qwen2_5_vl").text_config)
    with pytest.raises(UnsupportedModelError):
        get_adapter(torch.nn.Linear(2, 2))
