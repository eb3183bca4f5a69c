"""MMDU loader: image resolution, turn pairing, and problems reported and counted (never dropped)."""

import json

from PIL import Image

from vlm_kv.eval.mmdu_data import (
    BAD_FILE,
    MALFORMED_DIALOG,
    MALFORMED_TURN,
    MISSING_IMAGE,
    TAG_COUNT_MISMATCH,
    UNPAIRED_QUESTION,
    UNREADABLE_IMAGE,
    load_mmdu,
    resolve_image,
    split_question,
)


def _img(path, color=(200, 10, 10)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (20, 16), color).save(path)
    return path


def _write(tmp_path, bench):
    p = tmp_path / "benchmark.json"
    p.write_text(json.dumps(bench), encoding="utf-8")
    return p


def _u(v):
    return {"from": "user", "value": v}


def _a(v):
    return {"from": "assistant", "value": v}


def test_good_dialog_images_consumed_in_order_and_paths_resolved(tmp_path):
    root = tmp_path / "imgs_root"
    for name in ("a.png", "b.png", "c.png"):
        _img(root / "mmdu_pics" / name)
    bench = {
        "7": {
            "id": 7,
            # absolute paths of another machine: resolved by their trailing components
            "image": ["/mnt/authors/data/mmdu_pics/a.png", "./mmdu_pics/b.png", "c.png"],
            "conversations": [
                _u("<ImageHere><ImageHere>Compare."), _a("ref 1"),
                _u("Now text only."), _a("ref 2"),
                _u("And <ImageHere>?"), _a("ref 3"),
            ],
        }
    }
    data = load_mmdu(_write(tmp_path, bench), root)
    assert data.problems == []
    assert data.n_dialogs == 1 and data.n_questions == 3 and data.n_runnable_questions == 3
    d = data.dialogs[0]
    assert d.id == "7"
    assert [t.reference for t in d.turns] == ["ref 1", "ref 2", "ref 3"]
    assert [len(t.image_paths) for t in d.turns] == [2, 0, 1]
    assert d.turns[0].image_paths == [str(root / "mmdu_pics" / "a.png"), str(root / "mmdu_pics" / "b.png")]
    assert d.turns[2].image_paths == [str(root / "mmdu_pics" / "c.png")]
    assert data.summary()["n_unrunnable_questions"] == 0


def test_missing_image_is_reported_counted_and_blocks_later_turns(tmp_path):
    root = tmp_path / "root"
    _img(root / "x.png")
    bench = {
        "d": {
            "id": "d",
            "image": ["x.png", "gone.png"],
            "conversations": [_u("<ImageHere>one"), _a("r1"), _u("<ImageHere>two"), _a("r2"), _u("three"), _a("r3")],
        },
        "ok": {"id": "ok", "image": ["x.png"], "conversations": [_u("<ImageHere>q"), _a("r")]},
    }
    data = load_mmdu(_write(tmp_path, bench), root)
    assert data.problem_counts() == {MISSING_IMAGE: 1}
    p = data.problems[0]
    assert (p.dialog_id, p.turn, p.kind) == ("d", 1, MISSING_IMAGE)
    assert "gone.png" in p.detail
    d = data.dialogs[0]
    # nothing dropped: all three questions are kept
    assert d.n_questions == 3
    assert [t.runnable for t in d.turns] == [True, False, False]
    assert d.turns[1].problem == MISSING_IMAGE
    assert d.turns[2].problem.startswith("after_unrunnable_turn:1")
    assert data.n_questions == 4 and data.n_runnable_questions == 2
    assert data.summary()["n_unrunnable_questions"] == 2


def test_malformed_items_never_crash_and_are_all_accounted_for(tmp_path):
    root = tmp_path
    _img(root / "i.png")
    bench = {
        "not_an_object": [1, 2],
        "no_conv": {"id": "no_conv", "image": []},
        "too_few_images": {"id": "too_few_images", "image": ["i.png"],
                           "conversations": [_u("<ImageHere><ImageHere>q"), _a("r")]},
        "stray_and_unpaired": {"id": "stray_and_unpaired", "image": ["i.png", "i.png"],
                               "conversations": [_a("stray"), _u("<ImageHere>q1"), _a("r1"), _u("q2 no answer")]},
        "bad_value": {"id": "bad_value", "image": [], "conversations": [_u(None), _a("r"), _u("q"), _a("r2")]},
    }
    data = load_mmdu(_write(tmp_path, bench), root)
    counts = data.problem_counts()
    assert counts[MALFORMED_DIALOG] == 2  # not an object; conversations missing
    assert counts[TAG_COUNT_MISMATCH] == 2  # needs 2 images, has 1; one image never referenced
    assert counts[MALFORMED_TURN] == 2  # stray assistant entry; user value not text
    assert counts[UNPAIRED_QUESTION] == 1
    ids = [d.id for d in data.dialogs]
    assert ids == ["not_an_object", "no_conv", "too_few_images", "stray_and_unpaired", "bad_value"]
    by = {d.id: d for d in data.dialogs}
    assert by["too_few_images"].turns[0].problem == TAG_COUNT_MISMATCH
    sp = by["stray_and_unpaired"]
    assert [t.question for t in sp.turns] == ["<ImageHere>q1", "q2 no answer"]
    assert [t.runnable for t in sp.turns] == [True, False]
    bv = by["bad_value"]
    assert bv.n_questions == 2 and [t.runnable for t in bv.turns] == [False, False]
    assert data.n_questions == 5 and data.n_runnable_questions == 1


def test_bad_file_and_unreadable_image(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json", encoding="utf-8")
    data = load_mmdu(bad, tmp_path)
    assert data.dialogs == [] and data.problem_counts() == {BAD_FILE: 1}
    missing = load_mmdu(tmp_path / "nope.json", tmp_path)
    assert missing.problem_counts() == {BAD_FILE: 1}

    (tmp_path / "broken.png").write_bytes(b"not a png at all")
    bench = {"d": {"id": "d", "image": ["broken.png"], "conversations": [_u("<ImageHere>q"), _a("r")]}}
    p = _write(tmp_path, bench)
    assert load_mmdu(p, tmp_path).problems == []  # existence only by default
    data = load_mmdu(p, tmp_path, verify_images=True)
    assert data.problem_counts() == {UNREADABLE_IMAGE: 1}
    assert data.dialogs[0].turns[0].problem == UNREADABLE_IMAGE


def test_limit_duplicate_ids_and_list_input(tmp_path):
    bench = [
        {"id": "a", "image": [], "conversations": [_u("q"), _a("r")]},
        {"id": "a", "image": [], "conversations": [_u("q"), _a("r")]},
        {"id": "b", "image": [], "conversations": [_u("q"), _a("r")]},
    ]
    p = _write(tmp_path, bench)
    data = load_mmdu(p, tmp_path)
    assert [d.id for d in data.dialogs] == ["a", "a#2", "b"]
    assert data.problem_counts() == {MALFORMED_DIALOG: 1}
    assert [d.id for d in load_mmdu(p, tmp_path, limit=1).dialogs] == ["a"]


def test_resolve_image_and_split_question(tmp_path):
    f = _img(tmp_path / "sub" / "p.png")
    assert resolve_image(str(f), None) == str(f)
    assert resolve_image("/elsewhere/deep/sub/p.png", tmp_path) == str(f)
    assert resolve_image("p.png", tmp_path / "sub") == str(f)
    assert resolve_image("nothing.png", tmp_path) is None
    # a bare file name is also found anywhere under the root, but only when it is unique there
    assert resolve_image("/x/y/p.png", tmp_path) == str(f)
    _img(tmp_path / "one" / "dup.png")
    _img(tmp_path / "two" / "dup.png")
    data = load_mmdu(_write(tmp_path, {"d": {"id": "d", "image": ["dup.png"], "conversations": [_u("<ImageHere>"), _a("r")]}}), tmp_path)
    assert data.problem_counts() == {MISSING_IMAGE: 1}
    assert resolve_image("", tmp_path) is None
    assert split_question("A <ImageHere> and <ImageHere>.") == [("A ", None), ("", 0), (" and ", None), ("", 1), (".", None)]
    assert split_question("<ImageHere>") == [("", 0)]
    assert split_question("no tags") == [("no tags", None)]
