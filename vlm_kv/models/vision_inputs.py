"""Images and videos for Qwen VL processors, prepared the way qwen-vl-utils prepares them.

Qwen's own recipe sizes every image before the processor sees it: ``process_vision_info`` from
``qwen-vl-utils`` resizes each image so both sides are multiples of ``patch_size * 2`` and its
pixel count lies in ``[min_pixels, max_pixels]`` (the values users set, else the processor's
own limits), and samples video frames. The processor then runs with ``do_resize=False`` so it keeps those sizes.

    images, videos, video_kwargs = qwen_vision_info(messages, processor, min_pixels=256 * 28 * 28)
    inputs = processor(text=[text], images=images, videos=videos, do_resize=False, **video_kwargs)

qwen-vl-utils imports torchvision at module level; where torchvision cannot load (PyPI's
torchvision beside a CPU-only torch) images are sized by :func:`smart_resize`, the same rule
(tested against qwen-vl-utils' own ``fetch_image``), and videos raise ImportError.
"""

from __future__ import annotations

import math
from typing import Any

from PIL import Image

__all__ = ["is_qwen_vl_processor", "smart_resize", "resize_image", "qwen_vision_info", "with_pixel_limits"]

SPATIAL_MERGE = 2
MIN_TOKENS, MAX_TOKENS = 4, 16384  # qwen-vl-utils' defaults, in merged tokens per image
MAX_RATIO = 200


def is_qwen_vl_processor(processor: Any) -> bool:
    """True for the Qwen2-VL / 2.5-VL / 3-VL processors (their image processor has merge_size)."""
    name = type(processor).__name__
    return name.startswith(("Qwen2VL", "Qwen2_5_VL", "Qwen3VL")) and hasattr(processor, "image_processor")


def _patch_size(processor: Any) -> int:
    return int(getattr(processor.image_processor, "patch_size", 14))


def smart_resize(height: int, width: int, factor: int, min_pixels: int | None = None,
                 max_pixels: int | None = None) -> tuple[int, int]:
    """(height, width) rounded to multiples of ``factor`` with the pixel count clamped to
    ``[min_pixels, max_pixels]``, keeping the aspect ratio as closely as possible."""
    max_pixels = max_pixels if max_pixels is not None else MAX_TOKENS * factor**2
    min_pixels = min_pixels if min_pixels is not None else MIN_TOKENS * factor**2
    if max_pixels < min_pixels:
        raise ValueError(f"max_pixels {max_pixels} is smaller than min_pixels {min_pixels}")
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise ValueError(f"aspect ratio over {MAX_RATIO}: {height}x{width}")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    if h < factor or w < factor:
        raise ValueError(f"{height}x{width} with max_pixels {max_pixels} rounds to an empty image ({h}x{w}); "
                         "raise max_pixels")
    return h, w


def resize_image(image, patch_size: int, min_pixels: int | None = None, max_pixels: int | None = None):
    """An RGB copy of a PIL image at its :func:`smart_resize` size (qwen-vl-utils' ``fetch_image``)."""

    if image.mode == "RGBA":  # qwen-vl-utils composites transparency onto white
        rgb = Image.new("RGB", image.size, (255, 255, 255))
        rgb.paste(image, mask=image.split()[3])
    else:
        rgb = image.convert("RGB")
    factor = patch_size * SPATIAL_MERGE
    h, w = smart_resize(rgb.height, rgb.width, factor, min_pixels, max_pixels)
    return rgb.resize((w, h))


def with_pixel_limits(messages: list[dict], min_pixels: int | None, max_pixels: int | None) -> list[dict]:
    """A copy of chat messages whose image / video items carry ``min_pixels`` / ``max_pixels``
    (values an item sets itself win)."""
    limits = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = [{**limits, **c} if isinstance(c, dict) and c.get("type") in ("image", "video") else c
                       for c in content]
        out.append({**m, "content": content})
    return out


def qwen_vision_info(messages: list[dict], processor: Any, *, min_pixels: int | None = None,
                     max_pixels: int | None = None) -> tuple[list | None, list | None, dict]:
    """(images, videos, video processor kwargs) of chat ``messages`` for a Qwen VL processor.

    Limits not given default to the processor's own (``size`` shortest / longest edge, i.e.
    min / max pixels; for released Qwen checkpoints the same as qwen-vl-utils' defaults)."""
    size = getattr(processor.image_processor, "size", None) or {}
    if min_pixels is None:
        min_pixels = size.get("shortest_edge", getattr(processor.image_processor, "min_pixels", None))
    if max_pixels is None:
        max_pixels = size.get("longest_edge", getattr(processor.image_processor, "max_pixels", None))
    messages = with_pixel_limits(messages, min_pixels, max_pixels)
    patch = _patch_size(processor)
    try:
        from qwen_vl_utils import process_vision_info
    except Exception as exc:  # noqa: BLE001 - torchvision missing or unloadable under qwen-vl-utils
        return _images_only(messages, patch, exc)
    return process_vision_info(messages, return_video_kwargs=True, image_patch_size=patch)


def _images_only(messages: list[dict], patch: int, cause: BaseException):
    images = []
    for m in messages:
        for c in m.get("content") if isinstance(m.get("content"), list) else []:
            if not isinstance(c, dict):
                continue
            if c.get("type") == "video" or "video" in c:
                raise ImportError(f"video inputs need qwen-vl-utils with a working torchvision ({cause})") from cause
            if c.get("type") == "image" or "image" in c:
                image = c.get("image", c.get("image_url"))
                if isinstance(image, str):
                    with Image.open(image[7:] if image.startswith("file://") else image) as im:
                        image = im.copy()
                images.append(resize_image(image, patch, c.get("min_pixels"), c.get("max_pixels")))
    return (images or None), None, {}
