"""smollava: stock LLaVA around the real SmolLM2; its processor, template and trained parts."""

import pytest
import torch

from vlm_kv.models import smollava as S
from vlm_kv.eval.visual_tasks import make_item
from vlm_kv.eval.visual_qa import conversation_pieces, encode_pieces
from vlm_kv.train.vlm_train import visual_tokens


@pytest.fixture(scope="module")
def built(smollm2):
    model, tokenizer = smollm2
    return S.build_smollava(model, tokenizer)


def test_language_model_is_smollm2_unchanged(built, smollm2):
    model, _ = built
    lm, _ = smollm2
    ours, theirs = model.model.language_model.state_dict(), lm.model.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()
    assert model.config.image_token_id == S.IMAGE_TOKEN_ID
    trained = sum(v.numel() for v in S.trained_state(model).values())
    assert 1e6 < trained < 6e6  # the shipped file stays well under 25 MB in float32


def test_chat_template_matches_the_training_pieces(built):
    _, processor = built
    item = make_item("multi_turn", 1, 0, n_images=3, n_questions=2)
    answers = ["red", "K7Q2"]
    messages = []
    for k, q in enumerate(item.questions):
        text = (item.preamble + q.text) if k == 0 else q.text
        parts = []
        for j, chunk in enumerate(text.split("<image>")):
            if j:
                parts.append({"type": "image"})
            if chunk:
                parts.append({"type": "text", "text": chunk})
        messages.append({"role": "user", "content": parts})
        messages.append({"role": "assistant", "content": answers[k]})
    rendered = processor.apply_chat_template(messages, tokenize=False)
    assert rendered == "".join(p for p, _ in conversation_pieces(item, answers))


def test_processor_expands_images_and_normalizes_like_training(built):
    _, processor = built
    item = make_item("multi_image", 2, 0, n_images=2)
    text = "".join(p for p, _ in conversation_pieces(item))
    enc = processor(text=[text], images=[item.images], return_tensors="pt")
    assert int((enc["input_ids"] == S.IMAGE_TOKEN_ID).sum()) == 2 * S.IMAGE_TOKENS
    ids, labels = encode_pieces(processor.tokenizer, conversation_pieces(item))
    assert enc["input_ids"][0].tolist() == ids
    assert all(v == -100 for v in labels)
    assert torch.equal(enc["pixel_values"], S.pixel_values(item.images))


def test_visual_tokens_are_the_models_image_features(built):
    model, _ = built
    pixels = S.pixel_values(make_item("single", 0, 0).images)
    with torch.no_grad():
        ours = visual_tokens(model, pixels)
        stock = model.model.get_image_features(pixel_values=pixels, vision_feature_layer=-1,
                                               vision_feature_select_strategy="full").pooler_output
    assert ours.shape == (1, S.IMAGE_TOKENS, model.config.text_config.hidden_size)
    torch.testing.assert_close(ours[0], stock[0])


def test_trained_parts_round_trip_and_fail_closed(built, tmp_path):
    model, _ = built
    S.save_trained_parts(model, tmp_path, card={"steps": 0})
    key = next(iter(S.trained_state(model)))
    before = model.state_dict()[key].clone()
    with torch.no_grad():
        model.state_dict()[key].add_(1.0)
    S.load_trained_parts(model, tmp_path)
    assert torch.equal(model.state_dict()[key], before)
    with pytest.raises(FileNotFoundError, match="train-vlm"):
        S.load_trained_parts(model, tmp_path / "missing")
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / S.WEIGHTS_FILE))
    state.pop(key)
    save_file(state, str(tmp_path / S.WEIGHTS_FILE))
    with pytest.raises(ValueError, match="does not match"):
        S.load_trained_parts(model, tmp_path)


def test_pixel_values_refuses_other_sizes():
    from PIL import Image

    with pytest.raises(ValueError, match="224"):
        S.pixel_values([Image.new("RGB", (100, 100))])


def test_shipped_lora_is_merged_into_the_language_model_once(smollm2, tmp_path):
    from vlm_kv.models.lora import LoRASpec, attach_lora, lora_state

    lm, tokenizer = smollm2
    trained, _ = S.build_smollava(lm, tokenizer)
    spec = LoRASpec(rank=2, alpha=2.0, targets=("q_proj",))
    adapters = attach_lora(trained.model.language_model, spec)
    with torch.no_grad():
        for delta in adapters.values():
            delta.B.normal_(std=0.01)
    S.save_trained_parts(trained, tmp_path)
    S.save_lora(tmp_path, lora_state(adapters), spec)
    ids = torch.tensor([[1, 504, 3458, 314, 253]])
    with torch.no_grad():
        want = trained(input_ids=ids).logits
    loaded, _ = S.build_smollava(lm, tokenizer)
    S.load_trained_parts(loaded, tmp_path)
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert isinstance(loaded.model.language_model.layers[0].self_attn.q_proj, torch.nn.Linear)
    with pytest.raises(ValueError, match="already has LoRA"):
        S.load_trained_parts(loaded, tmp_path)
    plain, _ = S.build_smollava(lm, tokenizer)
    S.load_trained_parts(plain, tmp_path, with_lora=False)
    assert S.read_lora(tmp_path)[1] == spec
    with torch.no_grad():
        assert not torch.allclose(plain(input_ids=ids).logits, want, atol=1e-4)
