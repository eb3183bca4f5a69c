"""Planted-fact chats in the gate-training stream (issue 26's recipe), with SmolLM2's tokenizer."""

import random

import pytest
import torch

from vlm_kv.eval.planted_facts import FACT_KINDS, READ_REPLY, draw_fact, facts_chat, insert_at_depth
from vlm_kv.train.data import FactsMix, TrainingData


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2[1]


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "novel.txt"
    path.write_text(" ".join(f"Sentence number {i} tells of the long walk home." for i in range(600)))
    return str(path)


def test_every_fact_kind_is_planted_once_and_asked_later():
    rng = random.Random(0)
    for kind in FACT_KINDS:
        fact = draw_fact(rng, kind)
        assert fact.subject in fact.statement and fact.subject in fact.question and fact.answer in fact.statement
    messages = facts_chat("One. Two. Three. Four.", random.Random(1), 3)
    doc, asked = messages[0]["content"], messages[2::2]
    assert messages[1] == {"role": "assistant", "content": READ_REPLY} and len(asked) == 3
    answers = [m["content"] for m in messages[3::2]]
    assert all(a in doc for a in answers)  # every answer sits in the document, once planted
    assert not any(a in m["content"] for a in answers for m in asked)  # and never in a question
    assert insert_at_depth("A b. C d.", "X.", 0.0).startswith("X.") and insert_at_depth("A b. C d.", "X.", 1.0).endswith("X.")
    with pytest.raises(ValueError, match="fact kind"):
        draw_fact(rng, "colour")


def test_a_share_of_text_samples_become_fact_chats(tokenizer, text_file):
    plain = TrainingData([text_file], tokenizer, 512, seed=3)
    mixed = TrainingData([text_file], tokenizer, 512, seed=3, facts=FactsMix(0.5, per_sample=2))
    chats = 0
    for k in range(12):
        a, b = plain.sample(k), mixed.sample(k)
        assert b["input_ids"].shape[1] <= 512 and b["labels"].shape == b["input_ids"].shape
        text = tokenizer.decode(b["input_ids"][0])
        if READ_REPLY in text:
            chats += 1
            assert text.count("<|im_start|>user") == 3  # the document, then one question a fact
        else:
            assert (a["input_ids"] == b["input_ids"]).all()  # the other samples are untouched
    assert 2 <= chats <= 10
    again = TrainingData([text_file], tokenizer, 512, seed=3, facts=FactsMix(0.5, per_sample=2))
    assert all((again.sample(k)["input_ids"] == mixed.sample(k)["input_ids"]).all() for k in range(6))  # resumable


def test_bad_mixes_are_refused(tokenizer, text_file):
    with pytest.raises(ValueError, match="share must be in"):
        FactsMix(1.5)
    with pytest.raises(ValueError, match="no room"):
        TrainingData([text_file], tokenizer, 128, facts=FactsMix(1.0, per_sample=3)).sample(0)


def test_answer_mask_marks_exactly_the_answer_tokens(tokenizer, text_file):
    data = TrainingData([text_file], tokenizer, 512, seed=3, facts=FactsMix(1.0, per_sample=3))
    sample = data.sample(0)
    ids, labels, mask = sample["input_ids"][0], sample["labels"][0], sample["answer_mask"][0]
    assert mask.dtype == torch.bool and mask.shape == labels.shape
    marked = tokenizer.decode(labels[mask & (labels != -100)])
    chat = tokenizer.decode(ids)
    answers = [turn.split("\n", 1)[1].split("<|im_end|>")[0] for turn in chat.split("<|im_start|>assistant")[2:]]
    assert len(answers) == 3 and all(a and a in marked for a in answers)
    assert "?" not in marked and READ_REPLY not in marked  # no question, no acknowledgement
    plain = TrainingData([text_file], tokenizer, 512, seed=3, facts=FactsMix(0.5, per_sample=2))
    texts = [plain.sample(k) for k in range(12)]
    assert all("answer_mask" in s for s in texts)  # every sample of a facts stream has the key
    assert any(not s["answer_mask"].any() for s in texts) and any(s["answer_mask"].any() for s in texts)


def test_a_held_out_fact_kind_is_never_planted(tokenizer, text_file):
    data = TrainingData([text_file], tokenizer, 512, seed=5, facts=FactsMix(1.0, 3, kinds=("name", "date", "list")))
    chats = [tokenizer.decode(data.sample(k)["input_ids"][0]) for k in range(6)]
    assert all("keeper" in c or "made on" in c or "holds" in c for c in chats)
    assert not any("secret code" in c for c in chats)
    with pytest.raises(ValueError, match="fact kinds must be"):
        FactsMix(0.5, kinds=("name", "colour"))
