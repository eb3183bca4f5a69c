"""scripts/smollava_eval.py's per-question records (where a wrong colour answer comes from) and
scripts/smollava_text_lookup.py's scoring."""
import importlib.util
import re
from pathlib import Path

import pytest
from vlm_kv.eval.visual_tasks import make_item

REPO = Path(__file__).resolve().parents[1]


def _script(name: str = "smollava_eval"):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _colour_item_with_shape_elsewhere():
    """A held-out 4-image item whose colour question's shape also appears, in another colour, elsewhere."""
    for i in range(200):
        item = make_item("multi_image", 1, i, n_images=4, kinds=("colour",))
        q = item.questions[0]
        target = item.scenes[q.image_index]
        shape = next(o.shape for o in target.objects if o.colour == q.answer)
        for k, scene in enumerate(item.scenes):
            other = [o.colour for o in scene.objects if o.shape == shape and o.colour != q.answer]
            if k != q.image_index and other:
                return item, q, target, shape, k, other[0]
    raise AssertionError("no such item in 200 draws")


def test_wrong_colours_are_traced_to_their_source():
    S = _script()
    item, q, target, shape, k, elsewhere = _colour_item_with_shape_elsewhere()
    right = S._detail(item, q, q.answer, True)
    assert q.image_index + 1 in right["colour_of_same_shape_in_images"]  # other images may share shape and colour
    assert right["colour_of_another_object_in_target"] is False

    from_other_image = S._detail(item, q, elsewhere, False)
    assert k + 1 in from_other_image["colour_of_same_shape_in_images"]
    assert q.image_index + 1 not in from_other_image["colour_of_same_shape_in_images"]

    neighbour = next(o.colour for o in target.objects if o.shape != shape)
    from_neighbour = S._detail(item, q, neighbour, False)
    assert from_neighbour["colour_of_another_object_in_target"] is True

    summary = S.binding_summary([right, from_other_image, from_neighbour])
    assert summary["colour_questions"] == 3 and summary["colour_wrong"] == 2
    assert summary["colour_wrong_is_another_object_in_target"] == 1 + (elsewhere in {o.colour for o in target.objects})
    assert summary["colour_wrong_is_same_shape_elsewhere"] >= 1


def test_text_lookup_scores_the_first_word_of_the_asked_kind():
    T = _script("smollava_text_lookup")
    assert T.first_named("The triangle in image 3 is orange.", "colour") == "orange"
    assert T.first_named("The orange object in image 3 is a star.", "shape") == "star"
    assert T.first_named("I cannot tell.", "colour") is None


def test_text_lookup_writes_each_object_as_colour_then_shape():
    T = _script("smollava_text_lookup")
    item = make_item("multi_image", 1, 0, n_images=2, kinds=("colour",))
    for scene in item.scenes:
        text = T.scene_text(scene)
        assert scene.code[0] in text
        for obj in scene.objects:
            assert f" {obj.colour} {obj.shape}" in text
    assert item.questions[0].text in T.prompt(item)


def test_text_lookup_shape_first_swaps_each_object_and_nothing_else():
    T = _script("smollava_text_lookup")
    item = make_item("multi_image", 1, 3, n_images=3, kinds=("colour",))
    for scene in item.scenes:
        taught, swapped = T.scene_text(scene), T.scene_text(scene, "shape-first")
        assert sorted(re.findall(r"[a-z]+", taught)) == sorted(re.findall(r"[a-z]+", swapped))  # the same words
        for obj in scene.objects:
            assert f" {obj.shape} {obj.colour}" in swapped and f" {obj.colour} {obj.shape}" not in swapped
    assert T.prompt(item, "shape-first") != T.prompt(item)
    with pytest.raises(ValueError, match="unknown layout"):
        T.scene_text(item.scenes[0], "colour-last")
