"""smollava's generated questions as a local lmms-eval task: files, prompt, scoring (tiny LM, code paths)."""

import importlib.util
import json

import pytest

from vlm_kv.eval import lmms_tasks as T
from vlm_kv.eval.lmms_eval_model import VLMKVGenerator
from vlm_kv.eval.visual_qa import conversation_pieces, encode_pieces
from vlm_kv.eval.visual_tasks import make_item


@pytest.fixture(scope="module")
def tiny(tiny_smollava):
    return tiny_smollava


def _utils(folder):
    spec = importlib.util.spec_from_file_location("visual_utils", folder / f"{T.VISUAL_TASK_NAME}_utils.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_written_task_asks_what_training_asked_and_scores_exact_match(tiny, tmp_path):
    folder = T.write_visual_task(tmp_path / "tasks", data_seed=5, items=2, max_new_tokens=4)
    rows = [json.loads(x) for x in (folder / f"{T.VISUAL_TASK_NAME}.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and "max_new_tokens: 4" in (folder / f"{T.VISUAL_TASK_NAME}.yaml").read_text()
    utils = _utils(folder)
    item = make_item("single", 5, 0)
    (image,) = utils.doc_to_visual(rows[0])
    assert image.size == item.images[0].size and image.tobytes() == item.images[0].convert("RGB").tobytes()
    assert utils.doc_to_text(rows[0]) == "<image>\n" + item.questions[0].text
    # the lmms-eval model wrapper builds the same prompt the model was trained and evaluated on
    model, processor = tiny
    generator = VLMKVGenerator(model, processor, {"policy": "snapkv", "budget": 0.5}, max_new_tokens=2)
    inputs = generator._inputs(utils.doc_to_text(rows[0]), [image])
    trained = encode_pieces(processor.tokenizer, conversation_pieces(item, [], 1))[0]
    assert inputs["input_ids"][0].tolist() == trained
    assert utils.process_results(rows[0], [f" {rows[0]['answer'].upper()}."])["accuracy"] == 1.0
    assert utils.process_results(rows[0], ["no idea"])["accuracy"] == 0.0
    assert isinstance(generator.generate(utils.doc_to_text(rows[0]), [image]), str)
    with pytest.raises(ValueError, match="items must be"):
        T.write_visual_task(tmp_path / "x", 5, 0)
