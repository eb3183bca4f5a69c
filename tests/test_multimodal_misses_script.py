"""scripts/multimodal_misses.py: lost and gained answers grouped by kind, turn and the asked image's place."""
import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def misses():
    spec = importlib.util.spec_from_file_location("multimodal_misses", REPO / "scripts" / "multimodal_misses.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _q(turn, image, kind, full, cache):
    return {"item": 0, "turn": turn, "image": image, "images": 8, "kind": kind, "answer": "red",
            "full_correct": full, "correct": cache, "given": "blue"}


def _folder(tmp_path, questions, with_records=True):
    row = {"policy": "dbtrimkv", "budget": 0.1, "task": "multi_turn", "error": None}
    if with_records:
        row["questions"] = questions
    (tmp_path / "sweep_multimodal.json").write_text(json.dumps({"settings": {"data_seed": 2}, "rows": [row]}))
    return str(tmp_path)


def test_counts_lost_and_gained_by_group(misses, tmp_path):
    qs = [_q(1, 0, "colour", True, False), _q(2, 7, "colour", False, True), _q(3, 3, "code", True, True),
          _q(4, 1, "colour", True, False)]
    recs = misses.records([_folder(tmp_path, qs)], "dbtrimkv", 0.1, "multi_turn")
    assert all(r["seed"] == 2 for r in recs)
    by_kind = {r["group"]: r for r in misses.group_counts(recs, lambda q: q["kind"])}
    assert (by_kind["colour"]["questions"], by_kind["colour"]["lost"], by_kind["colour"]["gained"]) == (3, 2, 1)
    assert (by_kind["code"]["lost"], by_kind["code"]["gained"], by_kind["code"]["cache"]) == (0, 0, 1)
    by_place = {r["group"]: r["lost"] for r in misses.group_counts(recs, misses.place)}
    assert by_place == {"oldest third": 2, "middle third": 0, "newest third": 0}


def test_refuses_rows_without_records(misses, tmp_path):
    with pytest.raises(SystemExit, match="no per-question records"):
        misses.records([_folder(tmp_path, [], with_records=False)], "dbtrimkv", 0.1, "multi_turn")
    with pytest.raises(SystemExit, match="no snapkv row"):
        misses.records([str(tmp_path)], "snapkv", 0.1, "multi_turn")
