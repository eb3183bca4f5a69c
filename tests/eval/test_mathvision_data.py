"""MathVision loading: JSONL + images folder, the Hugging Face parquet layout, bad rows."""

from __future__ import annotations

import io
import json
import sys
import types
from pathlib import Path

import pytest
from PIL import Image

from vlm_kv.eval.mathvision_data import (
    MathVisionProblem,
    PyArrowMissing,
    default_data_dir,
    load_problems,
    problems_from_records,
    resolve_source,
)

MV = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "mathvision"


def _row(pid, **kw):
    row = {"id": pid, "question": f"Question {pid}\n<image1>", "options": [], "answer": "3",
           "solution": None, "level": 2, "subject": "counting", "image": f"images/{pid}.png"}
    row.update(kw)
    return row


def _png_bytes(color=(200, 10, 10)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (12, 9), color).save(buf, format="PNG")
    return buf.getvalue()


# ----------------------------------------------------------------------------- shipped data


def test_testmini_loads_with_images():
    problems = load_problems(MV)  # folder -> testmini.jsonl
    assert len(problems) == 304 and problems.n_errors == 0
    first = problems[0]
    assert isinstance(first, MathVisionProblem)
    assert (first.id, first.answer, first.level, first.subject, first.options) == ("4", "6", 1, "counting", [])
    assert first.image_path == MV / "images" / "4.jpg"
    img = first.load_image()
    assert img.mode == "RGB" and img.size[0] > 0
    mc = problems.by_id()["6"]
    assert mc.is_multiple_choice and mc.answer == "D" and mc.options == list("ABCDE")
    assert len(load_problems(MV, limit=5)) == 5


def test_full_test_split_reports_every_missing_image():
    problems = load_problems(MV / "test.jsonl")
    assert len(problems) == 3040  # nothing dropped
    # only the 304 testmini images are shipped
    assert problems.n_errors == 3040 - 304
    assert all("image not found" in err for _, err in problems.errors)
    with_image = {p.id for p in problems if not p.error}
    assert with_image == {p.id for p in load_problems(MV / "testmini.jsonl")}
    # scoring does not need images
    assert load_problems(MV / "test.jsonl", require_images=False).n_errors == 0


# ----------------------------------------------------------------------------- malformed rows


def test_malformed_rows_are_reported_per_item_and_counted(tmp_path):
    (tmp_path / "images").mkdir()
    for pid in ("1", "2", "3", "4", "5", "6", "8"):
        Image.new("RGB", (4, 4)).save(tmp_path / "images" / f"{pid}.png")
    lines = [
        json.dumps(_row("1")),                                            # fine
        json.dumps(_row("2", options=["x", "y", "z", "u", "v"], answer="C")),  # fine, multiple choice
        "{this is not json",                                              # invalid JSON
        json.dumps(_row("3", answer=None)),                               # no answer
        json.dumps(_row("4", options=["a", "b", "c"], answer="A")),       # 3 options
        json.dumps(_row("5", options=list("ABCDE"), answer="F")),         # answer not a letter
        json.dumps(_row("6", level="hard")),                              # bad level
        json.dumps(_row("7")),                                            # image missing on disk
        json.dumps(_row("1")),                                            # repeated id
        json.dumps(["not", "an", "object"]),                              # not an object
        json.dumps({k: v for k, v in _row("8").items() if k != "id"}),    # no id
        "",                                                               # blank lines are not rows
    ]
    path = tmp_path / "mini.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")

    problems = load_problems(path)
    assert len(problems) == 11
    assert problems.n_errors == 9
    errors = dict(problems.errors)
    assert [p.id for p in problems if not p.error] == ["1", "2"]
    assert "invalid JSON" in errors["mini.jsonl:3"]
    assert "missing 'answer'" in errors["3"]
    assert "3 entries" in errors["4"]
    assert "not a letter" in errors["5"]
    assert "'level'" in errors["6"]
    assert "image not found" in errors["7"]
    assert any("repeated id '1'" in e for _, e in problems.errors)
    assert "not a JSON object" in errors["mini.jsonl:10"]
    assert "missing 'id'" in errors["mini.jsonl:11"]
    # the first row of a repeated id is the one by_id keeps
    assert problems.by_id()["1"].error is None


def test_images_root_override(tmp_path):
    data = tmp_path / "data"
    pics = tmp_path / "pics" / "images"
    data.mkdir()
    pics.mkdir(parents=True)
    Image.new("RGB", (4, 4)).save(pics / "1.png")
    (data / "testmini.jsonl").write_text(json.dumps(_row("1")) + "\n", encoding="utf-8")
    assert load_problems(data).n_errors == 1
    problems = load_problems(data, images_root=tmp_path / "pics")
    assert problems.n_errors == 0 and problems[0].image_path == pics / "1.png"


# ----------------------------------------------------------------------------- parquet layout


class _FakeTable:
    def __init__(self, rows):
        self._rows = rows

    def to_pylist(self):
        return list(self._rows)


def _install_fake_pyarrow(monkeypatch, tables):
    pq = types.ModuleType("pyarrow.parquet")
    pq.read_table = lambda path: _FakeTable(tables[Path(path).name])
    pa = types.ModuleType("pyarrow")
    pa.parquet = pq
    monkeypatch.setitem(sys.modules, "pyarrow", pa)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", pq)


def test_parquet_layout_uses_decoded_image_bytes(tmp_path, monkeypatch):
    folder = tmp_path / "MathVision" / "data"
    folder.mkdir(parents=True)
    for name in ("testmini-00000-of-00001.parquet", "test-00000-of-00001.parquet"):
        (folder / name).write_bytes(b"PAR1")  # content is read by the (fake) pyarrow
    tables = {
        "testmini-00000-of-00001.parquet": [
            dict(_row("1"), decoded_image={"bytes": _png_bytes(), "path": "1.png"}),
            dict(_row("2", options=["p", "q", "r", "s", "t"], answer="E"), decoded_image=_png_bytes((0, 0, 255))),
            dict(_row("3"), decoded_image=None),  # no bytes and no file on disk
        ],
        "test-00000-of-00001.parquet": [dict(_row("9"), decoded_image={"bytes": _png_bytes()})],
    }
    _install_fake_pyarrow(monkeypatch, tables)

    kind, files = resolve_source(tmp_path / "MathVision")
    assert kind == "parquet" and [f.name for f in files] == ["testmini-00000-of-00001.parquet"]
    problems = load_problems(tmp_path / "MathVision")
    assert [p.id for p in problems] == ["1", "2", "3"]
    assert problems.n_errors == 1 and "image not found" in problems.by_id()["3"].error
    img = problems[1].load_image()
    assert img.size == (12, 9) and img.getpixel((0, 0)) == (0, 0, 255)
    assert problems[1].options == ["p", "q", "r", "s", "t"]
    assert [p.id for p in load_problems(tmp_path / "MathVision", split="test")] == ["9"]


def test_parquet_without_pyarrow_names_the_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes "import pyarrow" fail
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    path = tmp_path / "testmini-00000-of-00001.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(PyArrowMissing, match="pip install pyarrow"):
        load_problems(path)
    with pytest.raises(ImportError):
        load_problems(tmp_path)


def test_problems_from_records_counts_errors():
    problems = problems_from_records(
        [dict(_row("1"), decoded_image=_png_bytes()), {"id": "2"}, "junk"], require_images=True
    )
    assert len(problems) == 3 and problems.n_errors == 2
    assert problems[0].error is None and problems[0].image_bytes


# ----------------------------------------------------------------------------- locating data


def test_resolve_source_and_default_dir(tmp_path, monkeypatch):
    assert resolve_source(MV) == ("jsonl", [MV / "testmini.jsonl"])
    assert resolve_source(MV, split="test") == ("jsonl", [MV / "test.jsonl"])
    with pytest.raises(FileNotFoundError):
        resolve_source(tmp_path)
    with pytest.raises(FileNotFoundError):
        resolve_source(tmp_path / "nowhere")

    monkeypatch.delenv("VLM_KV_MATHVISION_DATA", raising=False)
    repo = Path(__file__).resolve().parents[2]
    assert default_data_dir(repo) == MV
    assert default_data_dir(repo / "tests" / "eval") == MV
    monkeypatch.setenv("VLM_KV_MATHVISION_DATA", str(tmp_path))
    assert default_data_dir(repo) == tmp_path
