"""Calibration windows from conversation JSONL (what ``train-gates`` reads and ``visual_export``
writes): each window is a chat's turns up to its first answer, every image in it, rendered as the
chat template renders it, with a tiny random-weight Qwen2.5-VL (code paths only); bad
conversations fail naming the file and the conversation."""
import json

import pytest
import torch
from PIL import Image

from vlm_kv.train.calibrate.calibrate import CalibrationConfig, Calibrator, calibrate
from vlm_kv.train.calibrate.data import ChatPrompt, check_image_data, image_windows, load_image_problems
from vlm_kv.testing import tiny_model, tiny_processor


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _chat(images: list[str], question: str = "Which image shows red?") -> dict:
    content = []
    for k, path in enumerate(images):
        content += [{"type": "text", "text": f"Image {k + 1}:"}, {"type": "image", "image": path}]
    content.append({"type": "text", "text": question})
    return {"messages": [{"role": "user", "content": content},
                         {"role": "assistant", "content": [{"type": "text", "text": "2"}]},
                         {"role": "user", "content": [{"type": "text", "text": "And blue?"}]},
                         {"role": "assistant", "content": [{"type": "text", "text": "1"}]}]}


def _write(folder, records, name="chats.jsonl"):
    path = folder / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chats")
    (folder / "images").mkdir()
    gen = torch.Generator().manual_seed(0)
    for i in range(3):
        pixels = torch.randint(0, 256, (56, 56, 3), generator=gen, dtype=torch.uint8).numpy()
        Image.fromarray(pixels).save(folder / "images" / f"{i}.png")
    data = _write(folder, [_chat(["images/0.png", "images/1.png"]), _chat(["images/2.png"]),
                           _chat(["images/1.png", "images/2.png", "images/0.png"])])
    return tiny_model("qwen2_5_vl", num_layers=2), tiny_processor("qwen2_5_vl"), data, folder


def _config(**kw):
    base = dict(budget=0.3, candidates=["tova", "h2o"], continuation=3, evict_every=2, windows_per_file=2, seed=1,
                max_pixels=56 * 56)
    base.update(kw)
    return CalibrationConfig(**base)


def test_a_window_is_the_chat_up_to_its_first_answer(setup):
    model, processor, data, folder = setup
    [(path, prompts)] = load_image_problems([data], str(folder))
    assert path == data and all(isinstance(p, ChatPrompt) for p in prompts)
    assert [p.image for p in prompts] == ["0.png,1.png", "2.png", "1.png,2.png,0.png"]
    assert all([m["role"] for m in p.messages] == ["user"] for p in prompts)  # the answers are not in the prompt
    windows = image_windows(model, processor, [data], str(folder), _config(windows_per_file=3))
    by_id = {w.info["id"]: w for w in windows}
    per_image = by_id["2"].info["image_tokens"]
    assert per_image > 0
    assert by_id["1"].info["image_tokens"] == 2 * per_image and by_id["3"].info["image_tokens"] == 3 * per_image
    # the prompt is the chat template's rendering, ending in the assistant's opening
    rendered = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "Image 1:"},
                                      {"type": "image", "image": Image.open(folder / "images" / "2.png").convert("RGB")},
                                      {"type": "text", "text": "Which image shows red?"}]}],
        tokenize=True, return_dict=True, return_tensors="pt", add_generation_prompt=True,
        images_kwargs={"max_pixels": 56 * 56})
    assert by_id["2"].ids.shape[1] == by_id["2"].context == rendered["input_ids"].shape[1]
    assert by_id["2"].generate == 3 and "pixel_values" in by_id["2"].inputs


def test_conversation_calibration_gives_shares(setup):
    model, processor, data, folder = setup
    strategy = calibrate(model, processor, [data], _config(), show_progress=False, images=str(folder))
    for entry in strategy.layers["prefill"]:
        assert set(entry.modality) == {"text", "image"} and sum(entry.modality.values()) == pytest.approx(1.0)
    cal = strategy.calibration
    assert cal["images"]["windows"] == 2 and cal["modalities"] == ["text", "image"]
    assert all(w["tokens"] == w["prompt_tokens"] + 4 for w in cal["data"])


def test_bad_conversations_fail_naming_them(setup, tmp_path):
    model, processor, _, folder = setup
    (tmp_path / "images").mkdir()
    missing = _write(tmp_path, [_chat(["images/gone.png"])])
    with pytest.raises(FileNotFoundError, match=r"conversation 1: image not found: .*gone\.png"):
        check_image_data([missing], str(tmp_path), 1)
    no_image = _write(tmp_path, [{"messages": [{"role": "user", "content": "hello"},
                                               {"role": "assistant", "content": "hi"}]}], "t.jsonl")
    with pytest.raises(ValueError, match="conversation 1 holds no image before its first answer"):
        check_image_data([no_image], str(tmp_path), 1)
    answer_first = _write(tmp_path, [{"messages": [{"role": "assistant", "content": "hi"}]}], "a.jsonl")
    with pytest.raises(ValueError, match="no user turn before its first answer"):
        check_image_data([answer_first], str(tmp_path), 1)
    mixed = tmp_path / "m.jsonl"
    mixed.write_text(json.dumps(_chat(["images/0.png"])) + "\n" + json.dumps({"text": "plain"}) + "\n")
    with pytest.raises(ValueError, match="1 text record"):
        check_image_data([str(mixed)], str(folder), 1)
    with pytest.raises(ValueError, match="holds only 3 problems"):
        Calibrator(model, processor, [str(folder / "chats.jsonl")], _config(windows_per_file=4), show_progress=False,
                   images=str(folder))
