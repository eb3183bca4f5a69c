"""Models taken by name: smollm2 and smollava, beside local folders."""

from pathlib import Path

import pytest
import torch
from transformers import LlavaForConditionalGeneration

import vlm_kv
from vlm_kv.models import smollava as S
from vlm_kv.models import named
from vlm_kv.models.smollm2 import ModelFileMissing

STAGE1 = Path(__file__).resolve().parents[2] / "train" / "checkpoints" / "smollava-stage1"


@pytest.fixture
def shipped(monkeypatch):
    """smollava with the committed stage-1 tower standing in for the shipped weights."""
    monkeypatch.setattr(S, "PRETRAINED_DIR", STAGE1)


def test_smollava_without_shipped_weights_fails_closed(monkeypatch, tmp_path):
    monkeypatch.setattr(S, "PRETRAINED_DIR", tmp_path)
    with pytest.raises(ModelFileMissing, match="ships no smollava vision weights"):
        named.check_model("smollava")
    with pytest.raises(FileNotFoundError, match="train-vlm"):
        named.load_vlm("smollava")


def test_unknown_names_and_folders_name_the_choices(tmp_path):
    with pytest.raises(ModelFileMissing, match="'smollm2' or 'smollava'"):
        named.check_model("smolava")
    with pytest.raises(ModelFileMissing, match="no config.json"):
        named.check_model(str(tmp_path))
    assert named.model_label("smollava") == "smollava"
    assert named.model_label(str(tmp_path)) == str(tmp_path.resolve())


def test_smollava_loads_by_name_as_a_vlm_and_as_a_text_model(shipped):
    named.check_model("smollava")
    assert named.is_vlm("smollava") and not named.is_vlm("smollm2")
    model, processor = named.load_vlm("smollava", device="cpu")
    assert isinstance(model, LlavaForConditionalGeneration) and not model.training
    assert processor.tokenizer is not None and hasattr(processor, "image_processor")
    text_model, tokenizer = vlm_kv.load_model("smollava")
    assert isinstance(text_model, LlavaForConditionalGeneration)
    assert tokenizer("a cat")["input_ids"] == processor.tokenizer("a cat")["input_ids"]
    # both carry the same trained tower
    a, b = S.trained_state(model), S.trained_state(text_model)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    # and, where the shipped folder has LM adapters, both merged them (once)
    ships_lora = S.read_lora(S.PRETRAINED_DIR) is not None
    assert getattr(model, "_vlm_kv_lora_merged", False) == ships_lora
    assert getattr(text_model, "_vlm_kv_lora_merged", False) == ships_lora
    cache = vlm_kv.make_cache(text_model, "snapkv", 0.5)
    assert isinstance(cache, vlm_kv.CompressedCache)


def test_smollava_with_a_folder_loads_those_trained_parts(shipped, tmp_path):
    # the shipped stand-in is STAGE1; a folder of other trained parts replaces it for this name only
    other = tmp_path / "other"
    model, _ = named.load_vlm("smollava", device="cpu")
    state = {k: v.clone() for k, v in S.trained_state(model).items()}
    key = next(k for k in state if k.startswith("model.multi_modal_projector."))
    for p_name, p in model.named_parameters():
        if p_name == key:
            p.data.add_(1.0)
    S.save_trained_parts(model, other)
    name = f"smollava:{other}"
    named.check_model(name)
    assert named.is_vlm(name) and named.model_label(name) == f"smollava:{other.resolve()}"
    loaded, _ = named.load_vlm(name, device="cpu")
    torch.testing.assert_close(S.trained_state(loaded)[key], state[key] + 1.0)
    text_model, _ = vlm_kv.load_model(name)
    torch.testing.assert_close(S.trained_state(text_model)[key], state[key] + 1.0)
    with pytest.raises(ModelFileMissing, match="no smollava trained parts"):
        named.check_model(f"smollava:{tmp_path / 'missing'}")
    with pytest.raises(ModelFileMissing, match="name the folder"):
        named.check_model("smollava:")
