"""Video entries in the training data format, and Qwen image sizing (min/max pixels) in training samples."""

import json
import sys

import pytest
import torch
from PIL import Image

from vlm_kv.testing import tiny_processor
from vlm_kv.train.data import TrainingData


class RecordingProcessor:
    """Records the messages it is asked to render (a processor whose video path needs no torchvision)."""

    def __init__(self):
        self.seen = []
        self.tokenizer = self

    def apply_chat_template(self, messages, **kwargs):
        self.seen.append(messages)
        return {"input_ids": torch.tensor([[5, 6, 7, 8]])}


def _frames(tmp_path, n, tag):
    paths = []
    for i in range(n):
        Image.new("RGB", (16 + i, 12), (40 * i, 10, 200)).save(tmp_path / f"{tag}{i}.png")
        paths.append(f"{tag}{i}.png")
    return paths


def test_video_entries_load_their_frames_in_order(tmp_path):
    llava = {"video": _frames(tmp_path, 3, "a"), "conversations": [
        {"from": "human", "value": "<video>\nWhat moves?"}, {"from": "gpt", "value": "A box."}]}
    messages = {"messages": [
        {"role": "user", "content": [{"type": "video", "video": _frames(tmp_path, 2, "b")},
                                     {"type": "text", "text": "And here?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Nothing."}]}]}
    path = tmp_path / "video.jsonl"
    path.write_text(json.dumps(llava) + "\n" + json.dumps(messages) + "\n")
    proc = RecordingProcessor()
    data = TrainingData([str(path)], proc, max_length=64)
    assert len(data) == 2
    for k in range(2):
        data.sample(k)
    by_frames = {len(m[0]["content"][0]["video"]): m for m in proc.seen}
    assert set(by_frames) == {2, 3}
    first = by_frames[3][0]["content"]
    assert [c["type"] for c in first] == ["video", "text"] and first[1]["text"] == "What moves?"
    assert [f.size for f in first[0]["video"]] == [(16, 12), (17, 12), (18, 12)]  # files, in order
    assert all(f.mode == "RGB" for f in first[0]["video"])


def test_bad_video_entries_are_refused(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"conversations": [{"from": "human", "value": "<video> hi"}]}) + "\n")
    with pytest.raises(ValueError, match="more <video> tags than videos"):
        TrainingData([str(path)], RecordingProcessor(), max_length=64)
    path.write_text(json.dumps({"messages": [{"role": "user", "content": [{"type": "video", "video": []}]}]}) + "\n")
    with pytest.raises(ValueError, match="non-empty list of frame paths"):
        TrainingData([str(path)], RecordingProcessor(), max_length=64)


def test_qwen_video_without_torchvision_says_why(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "qwen_vl_utils", None)  # as where torchvision cannot load
    path = tmp_path / "v.jsonl"
    path.write_text(json.dumps({"video": _frames(tmp_path, 2, "c"), "conversations": [
        {"from": "human", "value": "<video>\nWhat?"}, {"from": "gpt", "value": "Boxes."}]}) + "\n")
    data = TrainingData([str(path)], tiny_processor("qwen2_5_vl"), max_length=256)
    with pytest.raises(ImportError, match="video inputs need qwen-vl-utils"):
        data.sample(0)


def test_qwen_training_images_follow_max_pixels(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "qwen_vl_utils", None)
    Image.new("RGB", (500, 300), (1, 2, 3)).save(tmp_path / "big.png")
    path = tmp_path / "i.jsonl"
    path.write_text(json.dumps({"image": "big.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "Dark."}]}) + "\n")
    processor = tiny_processor("qwen2_5_vl")
    default = TrainingData([str(path)], processor, max_length=512).sample(0)
    large = TrainingData([str(path)], processor, max_length=512, max_pixels=4096).sample(0)
    assert default["image_grid_thw"].tolist() == [[1, 6, 10]]  # the processor's own 1024-pixel limit
    assert large["image_grid_thw"].tolist() == [[1, 12, 20]]
    n_image = int((large["input_ids"] == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")).sum())
    assert n_image == 12 * 20 // 4
