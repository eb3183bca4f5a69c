"""One loader for eval, training and lmms-eval: VLM folders, text model folders, clear errors."""

import pytest

from vlm_kv.loading import is_vlm_folder, load_model_and_processor, load_vlm, resolve_dtype
from vlm_kv.testing import save_tiny_vlm, tiny_model, tiny_processor


def test_vlm_folder_loads_model_and_image_processor(tmp_path):
    folder = save_tiny_vlm("qwen2_5_vl", tmp_path / "qwen")
    assert is_vlm_folder(folder)
    with pytest.warns(RuntimeWarning, match="without its video processor"):
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
