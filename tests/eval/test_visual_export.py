"""Visual tasks exported as conversations: train-gates reads them as the chat smollava was
trained on, with the answers marked for the answer-weighted loss."""

import json

import pytest
import torch

from vlm_kv.eval import visual_export as X
from vlm_kv.eval.visual_qa import IGNORE, conversation_pieces, encode_pieces
from vlm_kv.eval.visual_tasks import make_item
from vlm_kv.models import smollava as S
from vlm_kv.train.data import TrainingData


@pytest.fixture(scope="module")
def processor(smollm2):
    return S.smollava_processor(smollm2[1])


def test_exported_chats_render_as_the_training_chat_with_answers_marked(processor, tmp_path):
    path = X.export("multi_turn", 3, 2, tmp_path, progress=False, n_images=2, n_questions=2)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 2 and len(list((tmp_path / "images").glob("*.png"))) == 4
    data = TrainingData([str(path)], processor, 4096, image_token_id=S.IMAGE_TOKEN_ID, answer_turns=True)
    for rec in records:
        item = make_item("multi_turn", 3, rec["index"], n_images=2, n_questions=2)
        want_ids, want_labels = encode_pieces(processor.tokenizer,
                                              conversation_pieces(item, [q.answer for q in item.questions]))
        conv = data.conversations[rec["index"]]
        got = data._render(conv, with_answers=True)
        assert got["input_ids"][0].tolist() == want_ids
        assert got["pixel_values"].shape[0] == 2
        # label position t predicts token t + 1: the marked positions predict exactly the answers
        # with their end markers (and the template's newline after each turn)
        marked = [want_ids[t + 1] for t in torch.nonzero(got["answer_mask"][0]).flatten().tolist()]
        newline = processor.tokenizer.encode("\n", add_special_tokens=False)
        answers = [t for t in want_labels if t != IGNORE]
        end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
        want = []
        for t in answers:
            want += [t] + (newline if t == end else [])
        assert marked == want


def test_the_stream_carries_answer_masks_and_refuses_text_only(processor, tmp_path):
    path = X.export("multi_turn", 4, 1, tmp_path, progress=False, n_images=2, n_questions=2)
    text = tmp_path / "t.txt"
    text.write_text("Some plain text. " * 200)
    data = TrainingData([str(path), str(text)], processor, 2048, image_token_id=S.IMAGE_TOKEN_ID, answer_turns=True)
    samples = [data.sample(k) for k in range(len(data))]
    assert all("answer_mask" in s for s in samples)
    assert sum(int(s["answer_mask"].any()) for s in samples) == 1  # the conversation; text has no answers
    with pytest.raises(ValueError, match="hold no conversations"):
        TrainingData([str(text)], processor, 2048, answer_turns=True)


def test_a_cut_turn_is_not_marked(processor, tmp_path):
    path = X.export("multi_turn", 5, 1, tmp_path, progress=False, n_images=2, n_questions=2)
    full = TrainingData([str(path)], processor, 4096, image_token_id=S.IMAGE_TOKEN_ID, answer_turns=True)
    whole = full._render(full.conversations[0], with_answers=True)
    answer_at = torch.nonzero(whole["answer_mask"][0]).flatten()
    cut_at = int(answer_at[-1])  # inside the last answer
    short = TrainingData([str(path)], processor, cut_at, image_token_id=S.IMAGE_TOKEN_ID, answer_turns=True)
    got = short._render(short.conversations[0], with_answers=True)
    assert got["input_ids"].shape[1] == cut_at == got["answer_mask"].shape[1]
    assert torch.equal(got["answer_mask"][0], whole["answer_mask"][0, :cut_at])
