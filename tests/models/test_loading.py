"""One loader for eval, training and lmms-eval: VLM folders, text model folders, clear errors."""

import os
import warnings

import pytest

from vlm_kv.models.loading import IMAGE_ONLY_MARKER, is_vlm_folder, load_processor, load_vlm, resolve_dtype
from vlm_kv.models.named import load_model_and_processor
from vlm_kv.testing import save_tiny_vlm, tiny_model, tiny_processor


def test_vlm_folder_loads_model_and_image_processor(tmp_path):
    folder = save_tiny_vlm("qwen2_5_vl", tmp_path / "qwen")
    assert is_vlm_folder(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # saved image-only on purpose: nothing to warn about
        model, processor = load_model_and_processor(folder, device="cpu")
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration" and not model.training
    assert next(model.parameters()).dtype.is_floating_point and str(next(model.parameters()).dtype) == "torch.float32"
    assert hasattr(processor, "image_processor") and processor.tokenizer.chat_template


def test_text_folder_loads_model_and_tokenizer(tmp_path):
    folder = tmp_path / "llama"
    tiny_model("llama").save_pretrained(folder)
    tiny_processor("llama").save_pretrained(folder)
    assert not is_vlm_folder(folder)
    model, tok = load_model_and_processor(str(folder))
    assert type(model).__name__ == "LlamaForCausalLM" and hasattr(tok, "eos_token_id")


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="model folder not found"):
        load_vlm(tmp_path / "missing")
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float17", "cpu")


def test_a_lost_video_processor_warns_saying_what_to_do(tmp_path):
    # a checkpoint whose video processor cannot load here (no torchvision, no video config)
    folder = save_tiny_vlm("qwen2_5_vl", tmp_path / "qwen")
    os.remove(os.path.join(folder, IMAGE_ONLY_MARKER))
    with pytest.warns(RuntimeWarning) as caught:
        processor = load_processor(folder)
    (message,) = [str(w.message) for w in caught]
    assert "without its video processor" in message and "Images and text work; video inputs raise" in message
    assert "To feed videos: install a torchvision build" in message and IMAGE_ONLY_MARKER in message
    assert hasattr(processor, "image_processor") and not hasattr(processor, "video_processor")
