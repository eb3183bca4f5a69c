"""scripts/multimodal_code_trace.py: where a compressed cache holds an asked code's character patches.
End to end on the tiny smollava (code paths; the measurement is on the real one)."""
import importlib.util
from pathlib import Path

import pytest
import torch
from vlm_kv.eval.visual_qa import answer
from vlm_kv.eval.visual_tasks import GRID, make_item

from vlm_kv.models.smollava import IMAGE_TOKEN_ID, IMAGE_TOKENS

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def trace():
    spec = importlib.util.spec_from_file_location("multimodal_code_trace", REPO / "scripts" / "multimodal_code_trace.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("expected, given, kept", [
    ("AY8L", "AY8", [True, True, True, False]),
    ("SGZL", "szl", [True, False, True, True]),
    ("67PZ", "6", [True, False, False, False]),
    ("H7AV", "W442", [False, False, False, False]),
    ("LMDV", "LMDV.", [True, True, True, True]),
])
def test_kept_characters_align_the_answer_with_the_code(trace, expected, given, kept):
    assert trace.kept_characters(expected, given) == kept


def test_patch_positions_follow_the_image_blocks(trace):
    ids = torch.tensor([[5, 6] + [IMAGE_TOKEN_ID] * IMAGE_TOKENS + [7] * 3 + [IMAGE_TOKEN_ID] * IMAGE_TOKENS + [8]])
    first_of_second = 2 + IMAGE_TOKENS + 3
    assert trace.patch_positions(ids, 1, (2, 3), 4) == [first_of_second + 2 * GRID + 3 + k for k in range(4)]
    assert trace.patch_positions(ids, 0, (0, 1), 2) == [3, 4]
    with pytest.raises(ValueError, match="image 2 has 0 tokens"):
        trace.patch_positions(ids, 2, (0, 0), 4)


def test_turn_probe_inspects_once_per_generate_call(trace):
    seen = []
    probe = trace.TurnProbe(lambda ids: seen.append(ids.shape[1]))
    scores = torch.zeros(1, 4)
    for length in (10, 11, 12, 20, 21, 30):
        assert probe(torch.zeros(1, length, dtype=torch.long), scores) is scores
    assert seen == [10, 20, 30]


class _Layer:
    def __init__(self, positions, tiers):
        self.p, self.t = torch.tensor([positions]), torch.tensor([tiers], dtype=torch.uint8)

    def held_positions(self):
        return self.p, self.t


class _Cache:  # two layers, two KV heads; -1 pads a shorter head
    layers = (_Layer([[3, 4, 9], [4, -1, -1]], [[0, 1, 0], [1, 0, 0]]), _Layer([[9, 9, 9], [3, 4, 5]], [[0, 0, 0], [1, 1, 0]]))


def test_tier_counts_per_layer_and_head(trace):
    counts = trace.tier_counts(_Cache(), [3, 4])
    assert counts[0] == {"fp": [1, 0], "int2": [0, 1], "evicted": [1, 1]}
    assert counts[1] == {"fp": [0, 0], "int2": [2, 1], "evicted": [0, 1]}


def test_tier_totals_count_every_layer_head_and_position(trace):
    assert trace.tier_totals(_Cache(), [3, 4, 7]) == {"fp": 1, "int2": 4, "evicted": 2 * 2 * 3 - 5}


def test_summary_groups_kept_and_dropped_characters(trace):
    ch = lambda fp, q, e: {"fp": [fp], "int2": [q], "evicted": [e]}
    rows = [{"correct": True, "kept": [True, True], "chars": [ch(1, 0, 0), ch(1, 0, 0)]},
            {"correct": False, "kept": [True, False], "chars": [ch(0, 1, 0), ch(0, 0, 1)]},
            # wrong with the full cache too: not a loss of this cache
            {"correct": False, "full_correct": False, "kept": [False, False], "chars": [ch(1, 0, 0), ch(1, 0, 0)]}]
    s = trace.summarize(rows)
    assert s["answered questions, every character"]["fp"] == 1.0
    assert s["lost questions, characters the answer kept"]["int2"] == 1.0
    dropped = s["lost questions, characters the answer dropped"]
    assert (dropped["characters"], dropped["evicted"], dropped["layers_with_no_fp_head"]) == (1, 1.0, 1.0)
    rows[0]["image_rest"] = {"fp": 1, "int2": 2, "evicted": 1}
    rows[1]["image_rest"] = {"fp": 0, "int2": 0, "evicted": 4}
    rest = trace.summarize(rows)["the asked image's other patches"]
    assert (rest["fp"], rest["int2"], rest["evicted"]) == (0.125, 0.25, 0.625)


def test_full_answers_join_by_seed_item_and_turn(trace, tmp_path):
    import json
    q = lambda item, turn, ok: {"item": item, "turn": turn, "full_correct": ok}
    for seed in (1, 2):
        folder = tmp_path / str(seed)
        folder.mkdir()
        rows = [{"policy": "full", "task": "multi_turn", "questions": [q(0, 1, True), q(0, 2, seed == 2)]},
                {"policy": "dbtrimkv", "task": "multi_turn", "questions": [q(0, 1, False)]}]
        (folder / "sweep_multimodal.json").write_text(json.dumps({"settings": {"data_seed": seed}, "rows": rows}))
    full = trace.full_answers([str(tmp_path / "1"), str(tmp_path / "2")])
    assert full == {(1, 0, 1): True, (1, 0, 2): False, (2, 0, 1): True, (2, 0, 2): True}


def test_trace_item_on_a_tiered_cache(trace, tiny_smollava):
    model, processor = tiny_smollava
    item = next(it for it in (make_item("multi_turn", 3, i) for i in range(8)) if any(q.kind == "code" for q in it.questions))
    rows = trace.trace_item(model, processor.tokenizer, item, {"tiers": "int2"}, "snapkv", 0.1)
    codes = [q for q in item.questions if q.kind == "code"]
    assert [r["answer"] for r in rows] == [q.answer for q in codes]
    # the probe only watches: the answers are those of the same cache without it
    from vlm_kv.api import make_cache
    plain = answer(model, processor.tokenizer, item, 8, cache=make_cache(model, "snapkv", 0.1, tiers="int2"))
    by_turn = {k + 1: a for k, a in enumerate(plain)}
    heads = model.config.text_config.num_key_value_heads
    for r in rows:
        assert r["given"] == by_turn[r["turn"]]
        assert len(r["positions"]) == 4 and r["positions"] == sorted(r["positions"])
        assert sum(r["image_rest"].values()) == (IMAGE_TOKENS - 4) * heads * model.config.text_config.num_hidden_layers
        assert sum(r["other_images"].values()) == (len(item.scenes) - 1) * IMAGE_TOKENS * heads * model.config.text_config.num_hidden_layers
        for c in r["chars"]:
            assert len(c["fp"]) == model.config.text_config.num_hidden_layers
            assert all(f + q + e == heads for f, q, e in zip(c["fp"], c["int2"], c["evicted"]))
    # at a budget above the sequence nothing is evicted or quantized
    whole = trace.trace_item(model, processor.tokenizer, item, {}, "snapkv", 1.0)
    assert all(set(c["fp"]) == {heads} for r in whole for c in r["chars"])
