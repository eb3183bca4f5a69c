"""Procedural images and questions whose answers need the pixels (the ``smollava`` tasks).

Every image is 224 x 224 pixels, a 14 x 14 grid of 16-pixel cells (one visual token per cell).
It has a textured background with clutter and noise, one sign that carries a 4-character
code (one character a cell), and two to four saturated shapes, each filling a 2 x 2 block of
cells that never straddles the image's middle lines. Most cells are background, so most visual tokens are
redundant and a few carry the answer, as in real VLM inputs.

Question kinds (``Question.kind``):

* ``code``: "What is the code on the sign?" -> ``K7Q2``;
* ``colour``: "What colour is the triangle?" -> ``red`` (shapes are unique within an image);
* ``shape``: "What shape is the blue object?" -> ``star`` (colours are unique too);
* ``spatial``: "Is the red circle to the left or to the right of the blue star?" -> ``left``
  (asked only when the two objects lie in different halves of the image on that axis, so
  the answer is never a judgement call).

Contexts (``Item.task``):

* ``single``: one image and one question;
* ``multi_image``: 8-16 captioned images ("Image 3: a quiet harbour.") and one question about one
  of them (a multimodal needle);
* ``multi_turn``: 8 captioned images and 4-8 questions about different images, asked in turns.

Determinism and splits: item ``i`` of task ``t`` under data seed ``s`` is drawn from
``SeedSequence([s, TASK_CODES[t], i])``, so any (seed, task, index) reproduces one item exactly.
The shipped model was trained on data seed ``TRAIN_SEED`` only; every other seed is held out.

Each ``Scene`` also carries ``cell_tokens``: for every cell, the text the vision tower is taught
to put there in its first training stage (in an object's 2 x 2 block: its colour top left,
its shape top right, its horizontal half bottom left, its vertical half bottom right; one
code character per sign cell; a blank elsewhere). Each of those cells sees the part of the
object that its word describes, so a tower can learn them patch by patch (measured: with the
words placed in cells beside a one-cell object instead, a tower learnt the colour and the code
characters in 125 steps and none of the other words). That is a training signal only; questions are answered by the
language model from the visual tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

IMAGE_SIZE = 224
CELL = 16
GRID = IMAGE_SIZE // CELL  # 14 cells a side: 196 visual tokens an image
CODE_LENGTH = 4
CODE_CHARS = "ABCDEFGHJKLMNPRSTUVWXYZ23456789"  # no I / O / 0 / 1: they read alike at 16 pixels
COLOURS = {
    "red": (215, 35, 35),
    "green": (30, 165, 55),
    "blue": (35, 75, 225),
    "yellow": (240, 215, 30),
    "purple": (145, 50, 195),
    "orange": (250, 135, 20),
}
SHAPES = ("circle", "square", "triangle", "diamond", "star")
BLANK = " "  # what a background cell stands for
OBJECT_SPAN = 2  # an object fills OBJECT_SPAN x OBJECT_SPAN cells
MIDDLE = GRID // 2  # a block starting one cell before the middle would straddle it
CAPTIONS = (
    "a quiet harbour", "a city street", "a garden path", "an office desk", "a train station",
    "a market stall", "a mountain road", "a school yard", "a kitchen table", "a parking lot",
    "a river bank", "a bus stop", "a library shelf", "a football pitch", "a village square",
    "a workshop bench", "a museum hall", "a beach at noon", "a forest trail", "a hotel lobby",
)
TASKS = ("single", "multi_image", "multi_turn")
TASK_CODES = {"single": 1, "multi_image": 2, "multi_turn": 3}
KINDS = ("code", "colour", "shape", "spatial")
TRAIN_SEED = 0
IMAGE_MARK = "<image>"  # where an image goes in a question's text; the processor's token replaces it
# How captioned images are labelled in multi-image contexts: "open" writes "Image k: caption." before
# each image (the shipped model's layout); "bracketed" also writes "End of image k." after it, so the
# last patches of image k sit next to a label naming k rather than next to "Image k+1:".
LABEL_STYLES = ("open", "bracketed")

__all__ = [
    "IMAGE_SIZE", "CELL", "GRID", "TASKS", "KINDS", "TRAIN_SEED", "IMAGE_MARK", "LABEL_STYLES",
    "SceneObject", "Scene", "Question", "Item", "draw_scene", "make_item", "items", "noise_image",
    "answer_matches", "chance",
]


@dataclass(frozen=True)
class SceneObject:
    colour: str
    shape: str
    row: int
    col: int

    @property
    def horizontal(self) -> str:
        return "left" if self.col < MIDDLE else "right"

    @property
    def vertical(self) -> str:
        return "above" if self.row < MIDDLE else "below"


@dataclass
class Scene:
    image: Image.Image
    objects: list[SceneObject]
    code: str
    sign_cell: tuple[int, int]  # (row, first column) of the code's characters
    caption: str
    cell_tokens: list[list[str]]  # GRID x GRID texts, see the module docstring


@dataclass(frozen=True)
class Question:
    kind: str
    text: str
    answer: str
    image_index: int  # which image of the item it asks about
    choices: int  # size of the answer space (1 / choices is the chance of a blind guess)


@dataclass
class Item:
    task: str
    seed: int
    index: int
    scenes: list[Scene]
    questions: list[Question]
    preamble: str = ""  # the captioned images, before the first question
    meta: dict = field(default_factory=dict)

    @property
    def images(self) -> list[Image.Image]:
        return [s.image for s in self.scenes]


def _rng(seed: int, task: str, index: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, TASK_CODES[task], index])))


def _muted(rng: np.random.Generator, lo: int = 70, hi: int = 190) -> tuple[int, int, int]:
    base = int(rng.integers(lo, hi))
    return tuple(int(np.clip(base + rng.integers(-18, 19), 0, 255)) for _ in range(3))


def _background(rng: np.random.Generator) -> Image.Image:
    """A smooth two-colour gradient with low-frequency blotches: no blank canvas."""
    a, b = np.array(_muted(rng), float), np.array(_muted(rng), float)
    angle = rng.uniform(0, 2 * math.pi)
    yy, xx = np.mgrid[0:IMAGE_SIZE, 0:IMAGE_SIZE] / IMAGE_SIZE
    t = (np.cos(angle) * xx + np.sin(angle) * yy)
    t = (t - t.min()) / max(t.max() - t.min(), 1e-6)
    img = a[None, None] * (1 - t[..., None]) + b[None, None] * t[..., None]
    blot = rng.normal(0, 1, (8, 8))
    blot = np.array(Image.fromarray(((blot - blot.min()) / (np.ptp(blot) + 1e-6) * 255).astype(np.uint8))
                    .resize((IMAGE_SIZE, IMAGE_SIZE), Image.BICUBIC), float) / 255 - 0.5
    img = img + 30 * blot[..., None]
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def _clutter(draw: ImageDraw.ImageDraw, rng: np.random.Generator) -> None:
    """Desaturated lines, outlines and dots: texture a question never asks about."""
    for _ in range(int(rng.integers(6, 14))):
        colour = _muted(rng, 40, 220)
        kind = rng.integers(0, 3)
        x0, y0 = (int(v) for v in rng.integers(0, IMAGE_SIZE, 2))
        if kind == 0:
            x1, y1 = (int(v) for v in rng.integers(0, IMAGE_SIZE, 2))
            draw.line((x0, y0, x1, y1), fill=colour, width=int(rng.integers(1, 3)))
        elif kind == 1:
            w, h = (int(v) for v in rng.integers(10, 60, 2))
            draw.rectangle((x0, y0, x0 + w, y0 + h), outline=colour, width=1)
        else:
            r = int(rng.integers(2, 5))
            draw.ellipse((x0 - r, y0 - r, x0 + r, y0 + r), fill=colour)


def _shape_polygon(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    if shape == "triangle":
        return [(cx, cy - r), (cx + r, cy + r * 0.85), (cx - r, cy + r * 0.85)]
    if shape == "diamond":
        return [(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)]
    if shape == "star":
        points = []
        for k in range(10):
            rad = r if k % 2 == 0 else r * 0.45
            a = -math.pi / 2 + k * math.pi / 5
            points.append((cx + rad * math.cos(a), cy + rad * math.sin(a)))
        return points
    raise ValueError(f"no polygon for shape {shape!r}")


def _draw_object(draw: ImageDraw.ImageDraw, obj: SceneObject, rng: np.random.Generator) -> None:
    cx = (obj.col + 1) * CELL + rng.uniform(-1.5, 1.5)  # the centre of its 2 x 2 block
    cy = (obj.row + 1) * CELL + rng.uniform(-1.5, 1.5)
    r = rng.uniform(11.0, 14.0)
    fill = COLOURS[obj.colour]
    outline = tuple(max(0, c - 70) for c in fill)
    if obj.shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill, outline=outline)
    elif obj.shape == "square":
        s = r * 0.88
        draw.rectangle((cx - s, cy - s, cx + s, cy + s), fill=fill, outline=outline)
    else:
        draw.polygon(_shape_polygon(obj.shape, cx, cy, r), fill=fill, outline=outline)


_FONT: ImageFont.FreeTypeFont | None = None


def _font() -> ImageFont.FreeTypeFont:
    global _FONT
    if _FONT is None:
        _FONT = ImageFont.load_default(size=14)  # Pillow's bundled font: the same glyphs everywhere
    return _FONT


def _draw_sign(draw: ImageDraw.ImageDraw, code: str, row: int, col: int, rng: np.random.Generator) -> None:
    x0, y0 = col * CELL, row * CELL
    plate = (int(rng.integers(225, 256)), int(rng.integers(225, 256)), int(rng.integers(190, 256)))
    draw.rectangle((x0 - 2, y0 - 1, x0 + CELL * len(code) + 1, y0 + CELL), fill=plate, outline=(30, 30, 30))
    ink = tuple(int(v) for v in rng.integers(0, 60, 3))
    for k, ch in enumerate(code):
        left, top, right, bottom = _font().getbbox(ch)
        cx = x0 + k * CELL + (CELL - (right - left)) / 2 - left
        cy = y0 + (CELL - (bottom - top)) / 2 - top
        draw.text((cx, cy), ch, fill=ink, font=_font())


def _free_spans(taken: np.ndarray, span: int, rows: int = 1) -> list[tuple[int, int]]:
    spots = []
    for r in range(GRID - rows + 1):
        for c in range(GRID - span + 1):
            if not taken[r:r + rows, c:c + span].any():
                spots.append((r, c))
    return spots


def _reserve(taken: np.ndarray, row: int, col: int, span: int, rows: int = 1) -> None:
    # the reserved block plus a one-cell margin around it, so content never touches
    taken[max(0, row - 1):row + rows + 1, max(0, col - 1):col + span + 1] = True


def draw_scene(rng: np.random.Generator, n_objects: int | None = None) -> Scene:
    """One image with a sign, 2-4 objects of distinct colours and shapes, and its cell texts."""
    n_objects = int(rng.integers(2, 5)) if n_objects is None else n_objects
    img = _background(rng)
    draw = ImageDraw.Draw(img)
    _clutter(draw, rng)
    taken = np.zeros((GRID, GRID), bool)
    cells = [[BLANK] * GRID for _ in range(GRID)]

    code = "".join(rng.choice(list(CODE_CHARS), CODE_LENGTH))
    spots = [(r, c) for r, c in _free_spans(taken, CODE_LENGTH) if c >= 1]  # room for the plate's edge
    sign_row, sign_col = spots[int(rng.integers(len(spots)))]
    _reserve(taken, sign_row, sign_col, CODE_LENGTH)
    _draw_sign(draw, code, sign_row, sign_col, rng)
    for k, ch in enumerate(code):
        cells[sign_row][sign_col + k] = ch

    colours = rng.choice(list(COLOURS), n_objects, replace=False)
    shapes = rng.choice(list(SHAPES), n_objects, replace=False)
    objects = []
    for colour, shape in zip(colours, shapes):
        spots = [(r, c) for r, c in _free_spans(taken, OBJECT_SPAN, OBJECT_SPAN)
                 if r != MIDDLE - 1 and c != MIDDLE - 1]  # never on the middle lines: halves stay clear
        if not spots:
            break
        row, col = spots[int(rng.integers(len(spots)))]
        obj = SceneObject(str(colour), str(shape), row, col)
        _reserve(taken, row, col, OBJECT_SPAN, OBJECT_SPAN)
        _draw_object(draw, obj, rng)
        cells[row][col], cells[row][col + 1] = " " + obj.colour, " " + obj.shape
        cells[row + 1][col], cells[row + 1][col + 1] = " " + obj.horizontal, " " + obj.vertical
        objects.append(obj)

    arr = np.asarray(img.filter(ImageFilter.GaussianBlur(rng.uniform(0.0, 0.5))), float)
    arr = arr + rng.normal(0, rng.uniform(3, 9), arr.shape)
    image = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))
    caption = CAPTIONS[int(rng.integers(len(CAPTIONS)))]
    return Scene(image, objects, code, (sign_row, sign_col), caption, cells)


def noise_image(rng: np.random.Generator) -> Image.Image:
    """Pixels replaced by noise (the control that shows a model reads its images)."""
    return Image.fromarray(rng.integers(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8))


def _ask(rng: np.random.Generator, scene: Scene, image_index: int, where: str, kinds=KINDS) -> Question:
    kinds = list(kinds)
    objects = scene.objects
    pairs = _spatial_pairs(objects)
    if not pairs and "spatial" in kinds:
        kinds.remove("spatial")
    kind = kinds[int(rng.integers(len(kinds)))]
    if kind == "code":
        return Question(kind, f"What is the code on the sign{where}? Answer with the code only.", scene.code,
                        image_index, len(CODE_CHARS) ** CODE_LENGTH)
    if kind == "colour":
        obj = objects[int(rng.integers(len(objects)))]
        return Question(kind, f"What colour is the {obj.shape}{where}? Answer with one word.", obj.colour,
                        image_index, len(COLOURS))
    if kind == "shape":
        obj = objects[int(rng.integers(len(objects)))]
        return Question(kind, f"What shape is the {obj.colour} object{where}? Answer with one word.", obj.shape,
                        image_index, len(SHAPES))
    a, b, axis = pairs[int(rng.integers(len(pairs)))]
    if axis == "horizontal":
        text = (f"Is the {a.colour} {a.shape} to the left or to the right of the {b.colour} {b.shape}{where}? "
                "Answer with one word.")
        return Question(kind, text, a.horizontal, image_index, 2)
    text = f"Is the {a.colour} {a.shape} above or below the {b.colour} {b.shape}{where}? Answer with one word."
    return Question(kind, text, a.vertical, image_index, 2)


def _spatial_pairs(objects: list[SceneObject]) -> list[tuple[SceneObject, SceneObject, str]]:
    pairs = []
    for a in objects:
        for b in objects:
            if a is b:
                continue
            if a.horizontal != b.horizontal:
                pairs.append((a, b, "horizontal"))
            if a.vertical != b.vertical:
                pairs.append((a, b, "vertical"))
    return pairs


def _captioned(scenes: list[Scene], labels: str = "open") -> str:
    parts = []
    for k, scene in enumerate(scenes, start=1):
        parts.append(f"Image {k}: {scene.caption}.\n{IMAGE_MARK}\n")
        if labels == "bracketed":
            parts.append(f"End of image {k}.\n")
    return "".join(parts)


def make_item(task: str, seed: int, index: int, *, images: str = "real", n_images: int | None = None,
              n_questions: int | None = None, kinds=KINDS, labels: str = "open") -> Item:
    """Item ``index`` of ``task`` under data seed ``seed`` (see the module docstring).

    ``images="noise"`` keeps the questions and answers and replaces every image's pixels by
    noise. ``n_images`` / ``n_questions`` override the task's defaults (8-16 images for
    multi_image, 8 images and 4-8 questions for multi_turn). ``labels`` is one of
    ``LABEL_STYLES`` (how multi-image contexts name their images).
    """
    if task not in TASK_CODES:
        raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    if images not in ("real", "noise"):
        raise ValueError(f"images must be 'real' or 'noise', got {images!r}")
    if labels not in LABEL_STYLES:
        raise ValueError(f"labels must be one of {LABEL_STYLES}, got {labels!r}")
    unknown = set(kinds) - set(KINDS)
    if unknown or not kinds:
        raise ValueError(f"question kinds must be a non-empty subset of {KINDS}, got {tuple(kinds)}")
    rng = _rng(seed, task, index)
    if task == "single":
        scenes = [draw_scene(rng)]
        questions = [_ask(rng, scenes[0], 0, "", kinds)]
        preamble = f"{IMAGE_MARK}\n"
    else:
        default_images = int(rng.integers(8, 17)) if task == "multi_image" else 8
        n = n_images if n_images is not None else default_images
        if n < 1:
            raise ValueError(f"n_images must be >= 1, got {n}")
        scenes = [draw_scene(rng) for _ in range(n)]
        if task == "multi_image":
            count = 1
        else:
            count = n_questions if n_questions is not None else int(rng.integers(4, 9))
        if count > n:
            raise ValueError(f"{count} questions about different images need at least {count} images, got {n}")
        targets = rng.permutation(n)[:count]
        questions = [_ask(rng, scenes[k], int(k), f" in image {k + 1}", kinds) for k in targets]
        preamble = _captioned(scenes, labels)
    if images == "noise":
        for s in scenes:
            s.image = noise_image(rng)
    return Item(task, seed, index, scenes, questions, preamble)


def items(task: str, seed: int, count: int, start: int = 0, **kwargs) -> list[Item]:
    return [make_item(task, seed, i, **kwargs) for i in range(start, start + count)]


def normalize_answer(text: str) -> str:
    """Lower case, first line, no surrounding spaces or final punctuation (codes compare upper-cased)."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    return first.strip().strip(".!,;:'\"").strip().lower()


def answer_matches(generated: str, answer: str) -> bool:
    """Exact match after :func:`normalize_answer` (case-insensitive, trailing punctuation ignored)."""
    return normalize_answer(generated) == normalize_answer(answer)


def chance(questions: list[Question]) -> float:
    """Expected exact-match rate of a blind uniform guess over each question's answer space."""
    return float(np.mean([1.0 / q.choices for q in questions])) if questions else 0.0
