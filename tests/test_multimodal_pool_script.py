"""scripts/multimodal_pool.py: correct answers summed over data seeds, refusals on mismatched folders."""
import importlib.util
import json
from pathlib import Path

import pytest
from vlm_kv.eval.visual_tasks import make_item

REPO = Path(__file__).resolve().parents[1]
KINDS = ["code", "colour", "shape", "spatial"]


@pytest.fixture
def pool(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "scripts"))  # the script imports its siblings
    spec = importlib.util.spec_from_file_location("multimodal_pool", REPO / "scripts" / "multimodal_pool.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _questions(seed: int, items: int) -> int:
    return sum(len(make_item("multi_turn", seed, i, images="real", kinds=KINDS).questions) for i in range(items))


def _folder(tmp: Path, name: str, seed: int, full: int, cells: dict, items: int = 2) -> str:
    n = _questions(seed, items)
    rows = [{"policy": "full", "budget": 1.0, "task": "multi_turn", "accuracy": full / n, "full_accuracy": full / n,
             "kl": 0.0, "error": None}]
    rows += [{"policy": p, "budget": b, "task": "multi_turn", "accuracy": c / n, "full_accuracy": full / n,
              "kl": kl, "error": None} for (p, b), (c, kl) in cells.items()]
    settings = {"data_seed": seed, "items": items, "tasks": ["multi_turn"], "images": "real", "kinds": KINDS,
                "max_new_tokens": 8, "model": "smollava"}
    folder = tmp / name
    folder.mkdir()
    (folder / "sweep_multimodal.json").write_text(json.dumps({"settings": settings, "rows": rows}))
    return str(folder)


def test_pools_counts_over_seeds_and_keeps_one_seed_cells_apart(pool, tmp_path):
    n1, n2 = _questions(1, 2), _questions(2, 2)
    a = _folder(tmp_path, "a", 1, full=8, cells={("dbtrimkv", 0.1): (7, 0.2), ("snapkv", 0.1): (3, 1.0)})
    b = _folder(tmp_path, "b", 2, full=9, cells={("dbtrimkv", 0.1): (9, 0.1)})
    rows = {(r["cache"], r["budget"]): r for r in pool.pool(pool.load([a, b], "multi_turn"))}
    gates = rows[("dbtrimkv", 0.1)]
    assert (gates["correct"], gates["full"], gates["questions"]) == (16, 17, n1 + n2)
    assert gates["relative"] == pytest.approx(16 / 17)
    assert gates["kl"] == pytest.approx((0.2 * n1 + 0.1 * n2) / (n1 + n2))
    assert gates["relative_lo"] < gates["relative"] < gates["relative_hi"]
    assert "relative" not in rows[("snapkv", 0.1)] and rows[("snapkv", 0.1)]["seeds"] == [1]
    seeds = pool.load([a, b], "multi_turn")
    md = pool.table(pool.pool(seeds), seeds)
    assert "| snapkv | 0.1 | 3 | not run | not pooled: seed 1 only |" in md


def test_labels_separate_folders_of_one_seed(pool, tmp_path):
    a = _folder(tmp_path, "a", 1, full=8, cells={("dbtrimkv", 0.1): (7, 0.2)})
    b = _folder(tmp_path, "b", 1, full=8, cells={("dbtrimkv", 0.1): (6, 0.3)})
    rows = pool.pool(pool.load([a, f"{b}:+tiers"], "multi_turn"))
    assert sorted(r["cache"] for r in rows) == ["dbtrimkv", "dbtrimkv+tiers"]
    with pytest.raises(SystemExit, match="twice"):
        pool.load([a, b], "multi_turn")


def test_refuses_folders_whose_full_cache_disagrees(pool, tmp_path):
    a = _folder(tmp_path, "a", 1, full=8, cells={})
    b = _folder(tmp_path, "b", 1, full=7, cells={})
    with pytest.raises(SystemExit, match="full cache"):
        pool.load([a, b], "multi_turn")
