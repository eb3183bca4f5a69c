"""The generated smollava tasks: deterministic, answerable from the pixels, as the docstring says."""

import numpy as np
import pytest

from vlm_kv.eval import visual_tasks as T


def _pixels(item):
    return [np.asarray(im) for im in item.images]


def test_same_seed_task_index_gives_the_same_item():
    a, b = T.make_item("single", 5, 3), T.make_item("single", 5, 3)
    assert all((x == y).all() for x, y in zip(_pixels(a), _pixels(b)))
    assert a.questions == b.questions
    c = T.make_item("single", 6, 3)
    assert not all((x == y).all() for x, y in zip(_pixels(a), _pixels(c)))


@pytest.mark.parametrize("index", range(6))
def test_scene_cells_name_what_is_drawn_there(index):
    scene = T.make_item("single", 11, index).scenes[0]
    row, col = scene.sign_cell
    assert [scene.cell_tokens[row][col + k] for k in range(T.CODE_LENGTH)] == list(scene.code)
    assert len({o.colour for o in scene.objects}) == len(scene.objects) >= 2
    assert len({o.shape for o in scene.objects}) == len(scene.objects)
    for o in scene.objects:
        words = [scene.cell_tokens[o.row + r][o.col + c] for r in (0, 1) for c in (0, 1)]
        assert words == [" " + o.colour, " " + o.shape, " " + o.horizontal, " " + o.vertical]
        assert T.MIDDLE - 1 not in (o.row, o.col)  # a block never straddles a middle line
        # the object's block really holds its colour: the mean pixel at its centre is close to it
        cell = np.asarray(scene.image, float)[o.row * 16 + 12:o.row * 16 + 20, o.col * 16 + 12:o.col * 16 + 20]
        centre = cell.reshape(-1, 3).mean(0)
        assert np.abs(centre - np.array(T.COLOURS[o.colour])).mean() < 45
    blank = sum(t == T.BLANK for r in scene.cell_tokens for t in r)
    assert blank >= 0.8 * T.GRID * T.GRID  # most visual tokens are redundant background
    pixels = np.asarray(scene.image, float)
    assert pixels.std() > 10  # textured, not a blank canvas


def test_answers_follow_from_the_scene():
    kinds_seen = set()
    for i in range(40):
        item = T.make_item("single", 2, i)
        q, scene = item.questions[0], item.scenes[0]
        kinds_seen.add(q.kind)
        if q.kind == "code":
            assert q.answer == scene.code
        elif q.kind == "colour":
            (obj,) = [o for o in scene.objects if f"the {o.shape}?" in q.text]
            assert q.answer == obj.colour
        elif q.kind == "shape":
            (obj,) = [o for o in scene.objects if f"the {o.colour} object" in q.text]
            assert q.answer == obj.shape
        else:
            a = next(o for o in scene.objects if q.text.startswith(f"Is the {o.colour} {o.shape}"))
            b = next(o for o in scene.objects if f"the {o.colour} {o.shape}?" in q.text)
            if "left" in q.text:
                assert (q.answer == "left") == (a.col < b.col)
            else:
                assert (q.answer == "above") == (a.row < b.row)
    assert kinds_seen == set(T.KINDS)


def test_multi_image_item_asks_about_one_captioned_image():
    item = T.make_item("multi_image", 1, 0)
    n = len(item.scenes)
    assert 8 <= n <= 16
    assert item.preamble.count(T.IMAGE_MARK) == n
    assert all(f"Image {k + 1}: " in item.preamble for k in range(n))
    (q,) = item.questions
    assert f"in image {q.image_index + 1}?" in q.text


def test_bracketed_labels_close_every_image_and_change_nothing_else():
    open_, bracketed = T.make_item("multi_turn", 1, 2), T.make_item("multi_turn", 1, 2, labels="bracketed")
    assert open_.questions == bracketed.questions and [s.code for s in open_.scenes] == [s.code for s in bracketed.scenes]
    n = len(bracketed.scenes)
    chunks = bracketed.preamble.split(T.IMAGE_MARK)
    assert len(chunks) == n + 1
    for k in range(1, n):  # between image k and image k+1: first k's closing label, then k+1's opening one
        assert chunks[k].index(f"End of image {k}.") < chunks[k].index(f"Image {k + 1}: ")
    assert chunks[n].strip() == f"End of image {n}."
    stripped = bracketed.preamble
    for k in range(1, n + 1):
        stripped = stripped.replace(f"End of image {k}.\n", "")
    assert stripped == open_.preamble and "End of image" not in open_.preamble


def test_multi_turn_questions_are_about_different_images():
    item = T.make_item("multi_turn", 1, 4)
    assert len(item.scenes) == 8 and 4 <= len(item.questions) <= 8
    assert len({q.image_index for q in item.questions}) == len(item.questions)
    item = T.make_item("multi_turn", 1, 4, n_images=5, n_questions=5)
    assert len(item.scenes) == 5 and len(item.questions) == 5


def test_noise_images_keep_the_questions():
    real, noise = T.make_item("multi_turn", 3, 0), T.make_item("multi_turn", 3, 0, images="noise")
    assert real.questions == noise.questions
    assert all(np.abs(x.astype(int) - y.astype(int)).mean() > 30 for x, y in zip(_pixels(real), _pixels(noise)))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="unknown task"):
        T.make_item("video", 0, 0)
    with pytest.raises(ValueError, match="'real' or 'noise'"):
        T.make_item("single", 0, 0, images="blank")
    with pytest.raises(ValueError, match="at least 6 images"):
        T.make_item("multi_turn", 0, 0, n_images=4, n_questions=6)
    with pytest.raises(ValueError, match="kinds"):
        T.make_item("single", 0, 0, kinds=("count",))
    with pytest.raises(ValueError, match="labels must be one of"):
        T.make_item("multi_image", 0, 0, labels="closed")


def test_answer_matching_and_chance():
    assert T.answer_matches(" Red.\n", "red")
    assert T.answer_matches("k7q2", "K7Q2")
    assert not T.answer_matches("The circle is red.", "red")
    assert not T.answer_matches("", "red")
    qs = [T.Question("colour", "", "red", 0, 6), T.Question("spatial", "", "left", 0, 2)]
    assert T.chance(qs) == pytest.approx((1 / 6 + 1 / 2) / 2)
    only = T.make_item("single", 0, 0, kinds=("code",))
    assert only.questions[0].kind == "code"
