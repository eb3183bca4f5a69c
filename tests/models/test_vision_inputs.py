"""Qwen image sizing as qwen-vl-utils does it (min/max pixels), and its use in the MathVision inputs."""

import sys
import types

import pytest
from PIL import Image

from vlm_kv.testing import tiny_processor
from vlm_kv.models.vision_inputs import qwen_vision_info, resize_image, smart_resize

SIZES = [(500, 300), (37, 1200), (28, 28), (3000, 2000), (13, 17), (640, 480)]


@pytest.fixture()
def qwen_vl_utils_module(monkeypatch):
    """qwen-vl-utils' own module. It imports torchvision at module level (for video only); where
    torchvision cannot load, a stand-in lets the image code, which never touches it, import."""
    if not _torchvision_loads():
        tv = types.ModuleType("torchvision")
        tv.__version__ = "0.28.0"
        tv.io, tv.transforms = types.ModuleType("torchvision.io"), types.ModuleType("torchvision.transforms")
        tv.transforms.InterpolationMode = type("InterpolationMode", (), {"BICUBIC": 3})
        for name, mod in (("torchvision", tv), ("torchvision.io", tv.io), ("torchvision.transforms", tv.transforms)):
            monkeypatch.setitem(sys.modules, name, mod)
    for name in [m for m in sys.modules if m.startswith("qwen_vl_utils")]:
        monkeypatch.delitem(sys.modules, name)
    vp = pytest.importorskip("qwen_vl_utils.vision_process", reason="qwen-vl-utils not installed")
    return vp


def _torchvision_loads() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - a CUDA build beside CPU torch fails with RuntimeError
        return False
    return True


@pytest.mark.parametrize("limits", [{}, {"min_pixels": 256 * 28 * 28}, {"max_pixels": 64 * 28 * 28},
                                    {"min_pixels": 3136, "max_pixels": 200000}])
def test_sizes_match_qwen_vl_utils(qwen_vl_utils_module, limits):
    for h, w in SIZES:
        image = Image.new("RGBA" if h == 13 else "RGB", (w, h), (10, 200, 30, 128))
        theirs = qwen_vl_utils_module.fetch_image({"image": image, **limits}, image_patch_size=14)
        ours = resize_image(image, 14, limits.get("min_pixels"), limits.get("max_pixels"))
        assert ours.size == theirs.size, (h, w, limits)
        assert ours.tobytes() == theirs.tobytes()
        assert smart_resize(h, w, 28, limits.get("min_pixels"), limits.get("max_pixels")) == \
            qwen_vl_utils_module.smart_resize(h, w, 28, limits.get("min_pixels"), limits.get("max_pixels"))


def test_a_size_that_rounds_to_nothing_is_refused():
    with pytest.raises(ValueError, match="rounds to an empty image"):
        smart_resize(37, 1200, 28, 3136, 20000)


def test_pixel_limits_reach_the_processor(monkeypatch):
    monkeypatch.setitem(sys.modules, "qwen_vl_utils", None)  # the torchvision-free path
    processor = tiny_processor("qwen2_5_vl")  # patch 4 -> factor 8; its own limits 256..1024 pixels
    image = Image.new("RGB", (500, 300))
    msgs = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "?"}]}]
    (default,), _, _ = qwen_vision_info(msgs, processor)
    assert default.size == (40, 24)  # the processor's max 1024 pixels
    (big,), _, _ = qwen_vision_info(msgs, processor, max_pixels=4096)
    assert big.size == (80, 48)
    enc = processor(text=["<|vision_start|><|image_pad|><|vision_end|>?"], images=[big], do_resize=False,
                    return_tensors="pt")
    assert enc["image_grid_thw"].tolist() == [[1, 48 // 4, 80 // 4]]  # the size we chose, kept
    video = [{"role": "user", "content": [{"type": "video", "video": [image, image]}]}]
    with pytest.raises(ImportError, match="video inputs need qwen-vl-utils"):
        qwen_vision_info(video, processor)


def test_mathvision_inputs_follow_max_pixels():
    from vlm_kv.eval.mathvision_run import model_inputs
    from vlm_kv.testing import tiny_model

    model, processor = tiny_model("qwen2_5_vl"), tiny_processor("qwen2_5_vl")
    problem = {"question": "How many?", "options": []}
    image = Image.new("RGB", (500, 300))
    small = model_inputs(model, processor, problem, image, "authors")
    large = model_inputs(model, processor, problem, image, "authors", max_pixels=4096)
    assert small["image_grid_thw"].tolist() == [[1, 6, 10]]
    assert large["image_grid_thw"].tolist() == [[1, 12, 20]]
    with pytest.raises(ValueError, match="apply to Qwen VL processors"):
        model_inputs(tiny_model("llava"), tiny_processor("llava"), problem, image, "authors", max_pixels=4096)
