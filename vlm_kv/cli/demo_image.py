"""``vlm-kv demo --image``: smollava answers a question about one of several images, full cache vs
compressed cache, and draws which image patches the compressed cache kept.

The item is a held-out ``multi_image`` context of the generated tasks (``vlm_kv.eval.visual_tasks``,
data seed 1 by default; training used seed 0 only): a few captioned images and one question about
one of them. The prompt and the greedy answers come from ``vlm_kv.eval.visual_qa``, the code the
multimodal benchmark runs, so the demo asks exactly what the benchmark asks.

The PNG shows every image twice: as the model saw it, and with each 16 x 16 patch (one visual
token) dimmed by the share of (layer, KV head) pairs whose cache no longer holds it. A patch
every layer and head kept looks unchanged; one evicted everywhere is nearly black.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont
from transformers import DynamicCache

from vlm_kv.api import check_cache_options, make_cache
from vlm_kv.cache.report import cache_bytes
from vlm_kv.eval.visual_qa import answer, conversation_pieces, encode_pieces
from vlm_kv.eval.visual_tasks import CELL, GRID, IMAGE_SIZE, Item, answer_matches, make_item
from vlm_kv.models.named import load_model_and_processor
from vlm_kv.policies import normalize_policy_name

__all__ = ["ImageDemoSettings", "ImageDemoResult", "run_image_demo", "demo_item", "prompt_ids",
           "kept_patch_counts", "render_png", "png_size"]

MODEL = "smollava"
TASK = "multi_image"
PATCHES = GRID * GRID  # visual tokens an image (smollava keeps every patch: no CLS token)

# PNG layout, in pixels: each image is drawn SCALE times its size so that one patch is a visible square
SCALE = 2
PAD = 12
HEADER = 52   # two lines of text above the panels
LABEL = 22    # one line above each row of panels
FOOTER = 40   # the legend bar and its labels
ASKED_COLOUR = (220, 30, 30)
DIM_FLOOR = 0.12  # brightness of a patch no (layer, head) pair kept: dark, but its outline still shows


@dataclass(frozen=True)
class ImageDemoSettings:
    policy: str = "dbtrimkv"   # smollava's own gates ship with it
    budget: float | int = 0.25
    data_seed: int = 1          # held out: the shipped tower was trained on seed 0 only
    index: int = 0              # which item of the seed
    images: int = 4             # images in the context; one question about one of them
    max_new_tokens: int = 16    # answers are one word or a 4-character code; the model stops at <|im_end|>
    png: str | Path = "vlm_kv_demo.png"
    gates: str | None = None
    strategy: str | None = None

    def cache_kwargs(self) -> dict:
        out: dict = {}
        if self.gates:
            out["gates"] = self.gates
        if self.strategy:
            out["strategy"] = self.strategy
        return out

    def validate(self) -> str:
        """The policy's registry key; every check that needs no model (a bad name fails here)."""
        key = normalize_policy_name(self.policy)
        check_cache_options(key, self.budget, **self.cache_kwargs())
        if self.images < 1:
            raise ValueError(f"--images must be >= 1, got {self.images}")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.data_seed < 0 or self.index < 0:
            raise ValueError(f"data seed and item index must be >= 0, got {self.data_seed} and {self.index}")
        return key


@dataclass
class ImageDemoResult:
    item: Item
    question: str
    expected: str
    full_answer: str
    compressed_answer: str
    full_bytes: int
    compressed_bytes: int
    kept: np.ndarray            # [images, GRID, GRID]: share of (layer, KV head) pairs holding each patch
    pairs: int                  # (layer, KV head) pairs of the language model
    png: Path
    seconds: tuple[float, float] = field(default=(0.0, 0.0))  # full, compressed

    @property
    def asked_image(self) -> int:
        return self.item.questions[0].image_index


def demo_item(settings: ImageDemoSettings) -> Item:
    """The held-out context: ``images`` captioned images and one question about one of them."""
    return make_item(TASK, settings.data_seed, settings.index, n_images=settings.images)


def prompt_ids(tokenizer, item: Item) -> np.ndarray:
    """The token ids of the first turn, as ``visual_qa.answer`` feeds them (images expanded)."""
    return np.asarray(encode_pieces(tokenizer, conversation_pieces(item, [], 1))[0], dtype=np.int64)


def _image_token_id(model) -> int:
    config = model.config
    token = getattr(config, "image_token_id", None)
    if token is None:
        token = getattr(config, "image_token_index", None)
    if token is None:
        raise ValueError(f"{type(model).__name__}: its config names no image token id")
    return int(token)


def _pairs(model) -> tuple[int, int]:
    text = getattr(model.config, "text_config", model.config)
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return int(text.num_hidden_layers), int(heads)


def kept_patch_counts(cache, ids: np.ndarray, image_token_id: int, n_images: int, pairs: int) -> np.ndarray:
    """[n_images, GRID, GRID] int: how many (layer, KV head) pairs hold each image patch.

    Visual token ``j`` of image ``k`` is the ``j``-th image token of image ``k`` in ``ids`` (the
    processor expands each image to ``PATCHES`` consecutive tokens, in the tower's row-major patch
    order), and a cache entry is that token when its original position is the token's index in
    ``ids``. A cache without ``held_positions`` (DynamicCache, policy "full") holds everything.
    Entries in an INT2 tier count as kept: they are still attended.
    """
    positions = np.flatnonzero(ids == image_token_id)
    if positions.size != n_images * PATCHES:
        raise ValueError(f"{positions.size} image tokens in the prompt, expected {n_images} x {PATCHES}")
    if not any(hasattr(layer, "held_positions") for layer in getattr(cache, "layers", [])):
        return np.full((n_images, GRID, GRID), pairs, dtype=np.int64)
    patch_of = np.full(ids.size, -1, dtype=np.int64)  # prompt position -> patch number (or -1: text)
    patch_of[positions] = np.arange(positions.size)
    counts = np.zeros(positions.size, dtype=np.int64)
    for layer in cache.layers:
        held, _tier = layer.held_positions()  # [B, H, L], -1 past a row's end
        for row in held[0].cpu().numpy():     # one KV head of batch row 0 (the demo's only row)
            row = np.unique(row[(row >= 0) & (row < ids.size)])  # generated tokens lie past the prompt
            patches = patch_of[row]
            counts += np.bincount(patches[patches >= 0], minlength=counts.size)
    return counts.reshape(n_images, GRID, GRID)


def png_size(n_images: int, scale: int = SCALE) -> tuple[int, int]:
    """(width, height) of the PNG for ``n_images`` images: two rows of panels (image, kept patches)."""
    side = IMAGE_SIZE * scale
    return n_images * side + (n_images + 1) * PAD, HEADER + 2 * (LABEL + side) + PAD + FOOTER


def _font(size: int) -> ImageFont.ImageFont:
    return ImageFont.load_default(size=size)  # Pillow's bundled font: nothing to install


def _kept_panel(image: Image.Image, share: np.ndarray, scale: int) -> Image.Image:
    """``image`` with each patch's brightness scaled by its kept share (1: unchanged)."""
    pixels = np.asarray(image.convert("RGB"), dtype=np.float32)
    factor = DIM_FLOOR + (1.0 - DIM_FLOOR) * share.astype(np.float32)
    factor = np.kron(factor, np.ones((CELL, CELL), dtype=np.float32))[..., None]  # patch -> its 16 x 16 pixels
    out = Image.fromarray(np.clip(pixels * factor + 0.5, 0, 255).astype(np.uint8))
    return out.resize((IMAGE_SIZE * scale,) * 2, Image.NEAREST)


def render_png(images: list[Image.Image], kept: np.ndarray, asked: int, path: str | Path, title: list[str],
               scale: int = SCALE) -> Path:
    """Write the PNG: images on top, kept patches below, the asked image framed in red."""
    if kept.shape != (len(images), GRID, GRID):
        raise ValueError(f"kept map of shape {kept.shape} for {len(images)} images")
    if float(kept.min()) < 0.0 or float(kept.max()) > 1.0:
        raise ValueError("kept shares must lie in [0, 1]")
    side = IMAGE_SIZE * scale
    canvas = Image.new("RGB", png_size(len(images), scale), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    small, normal = _font(13), _font(15)
    for k, line in enumerate(title[:2]):
        draw.text((PAD, 8 + 20 * k), line, fill=(0, 0, 0), font=normal)
    top_rows = (HEADER, HEADER + LABEL + side)
    for k, image in enumerate(images):
        x = PAD + k * (side + PAD)
        asked_mark = " (asked)" if k == asked else ""
        panels = (image.convert("RGB").resize((side, side), Image.NEAREST), _kept_panel(image, kept[k], scale))
        labels = (f"Image {k + 1}{asked_mark}",
                  f"Image {k + 1}{asked_mark}: {kept[k].mean():.0%} of its visual entries kept")
        for y, panel, text in zip(top_rows, panels, labels):
            draw.text((x, y + 3), text, fill=ASKED_COLOUR if k == asked else (0, 0, 0), font=small)
            canvas.paste(panel, (x, y + LABEL))
            if k == asked:
                draw.rectangle((x - 3, y + LABEL - 3, x + side + 2, y + LABEL + side + 2), outline=ASKED_COLOUR,
                               width=3)
    # legend: the brightness a share maps to, 0 to 1
    y = HEADER + 2 * (LABEL + side) + PAD
    width = min(300, canvas.width - 2 * PAD - 200)
    if width > 20:
        ramp = DIM_FLOOR + (1.0 - DIM_FLOOR) * np.linspace(0.0, 1.0, width, dtype=np.float32)
        bar = np.repeat((ramp * 235.0)[None, :, None], 12, axis=0).repeat(3, axis=2)
        canvas.paste(Image.fromarray(bar.astype(np.uint8)), (PAD, y))
        draw.text((PAD, y + 15), "0", fill=(0, 0, 0), font=small)
        draw.text((PAD + width - 30, y + 15), "100%", fill=(0, 0, 0), font=small)
        draw.text((PAD + width + 10, y), "lower row: patch brightness = share of (layer, KV head) pairs that kept it",
                  fill=(0, 0, 0), font=small)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(path, format="PNG", optimize=True)
    return path


def _answer_timed(model, tokenizer, item: Item, max_new_tokens: int, cache) -> tuple[str, float]:
    start = time.perf_counter()
    (text,) = answer(model, tokenizer, item, max_new_tokens, cache=cache)
    return " ".join(text.split()), time.perf_counter() - start


def _verdict(text: str, expected: str) -> str:
    return "right" if answer_matches(text, expected) else "wrong"


def run_image_demo(settings: ImageDemoSettings = ImageDemoSettings(), loaded: tuple | None = None,
                   verbose: bool = True) -> ImageDemoResult:
    """Answer one held-out image question with the full and the compressed cache, print both with
    their KV bytes, and write the kept-patch PNG. ``loaded`` = (model, processor) of a LLaVA-style
    VLM (default: smollava, loaded offline). Arguments are checked before any model loads."""

    policy = settings.validate()
    say = print if verbose else (lambda *a, **k: None)
    if loaded is None:
        say(f"Loading {MODEL} (SmolLM2-135M-Instruct + the shipped vision tower, fp32, CPU) ...", flush=True)
        loaded = load_model_and_processor(MODEL, device="cpu", dtype=torch.float32)
    model, processor = loaded
    tokenizer = getattr(processor, "tokenizer", processor)
    item = demo_item(settings)
    question = item.questions[0]
    ids = prompt_ids(tokenizer, item)
    token_id = _image_token_id(model)
    layers, heads = _pairs(model)
    pairs = layers * heads

    # both caches exist before either runs, as in the text demo: make_cache may switch the model's
    # attention implementation, and the full cache must run under the same one
    full = DynamicCache()
    small = make_cache(model, policy, settings.budget, **settings.cache_kwargs())
    full_text, full_s = _answer_timed(model, tokenizer, item, settings.max_new_tokens, full)
    small_text, small_s = _answer_timed(model, tokenizer, item, settings.max_new_tokens, small)
    counts = kept_patch_counts(small, ids, token_id, len(item.scenes), pairs)
    kept = counts / pairs
    b_full, b_small = cache_bytes(full), cache_bytes(small)
    label = f"{policy} @ {settings.budget}"
    asked = question.image_index
    title = [f"{MODEL}: {len(item.scenes)} images, {ids.size} prompt tokens ({(ids == token_id).sum()} visual), "
             f"data seed {settings.data_seed}, item {settings.index}; compressed cache {label}",
             f"Q: {question.text}  expected {question.answer!r}; full cache {full_text!r}, {label} {small_text!r}"]
    png = render_png(item.images, kept, asked, settings.png, title)

    width = 40
    say(f"Context: {len(item.scenes)} captioned images (data seed {settings.data_seed}, item {settings.index}, "
        f"held out), {ids.size} prompt tokens, {int((ids == token_id).sum())} of them visual.")
    say(f"Question about image {asked + 1} ({question.kind}): {question.text}")
    say(f"Expected answer: {question.answer}\n")
    say(f"{'full cache (DynamicCache)':<{width}} | {label:<{width}}")
    say("-" * (2 * width + 3))
    say(f"{f'{full_text!r} ({_verdict(full_text, question.answer)})':<{width}} | "
        f"{f'{small_text!r} ({_verdict(small_text, question.answer)})':<{width}}")
    say(f"{f'{full_s:.1f} s':<{width}} | {f'{small_s:.1f} s':<{width}}")
    left = f"KV {b_full:,} bytes ({b_full / 2**20:.2f} MiB)"
    right = f"KV {b_small:,} bytes ({b_small / b_full:.0%} of full)"
    say(f"{left:<{width}} | {right:<{width}}\n")
    per_image = ", ".join(f"{k + 1}{'*' if k == asked else ''} {kept[k].mean():.0%}" for k in range(len(item.scenes)))
    say(f"Visual entries kept ({pairs} layer x KV head pairs): {kept.mean():.0%} over all images; "
        f"per image ({asked + 1}* asked): {per_image}")
    say(f"PNG: {png}")
    return ImageDemoResult(item, question.text, question.answer, full_text, small_text, b_full, b_small, kept, pairs,
                           png, (full_s, small_s))
