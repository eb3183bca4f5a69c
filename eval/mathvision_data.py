"""Loading MathVision (MATH-Vision) problems.

Two layouts are read:

* **JSONL + images folder** (the authors' GitHub layout, and
  ``shared/data/mathvision``): one JSON object per line with ``id``,
  ``question``, ``options``, ``answer``, ``solution``, ``level``, ``subject``
  and ``image`` (a path relative to the JSONL's folder, e.g.
  ``images/4.jpg``).
* **Hugging Face parquet** (``MathLLMs/MathVision``): the same columns, plus
  the image bytes in ``decoded_image`` (a ``{"bytes", "path"}`` struct).
  Needs ``pyarrow``, imported only when a parquet file is read.

Bad input never stops loading and never disappears: a row that cannot be
parsed or fails validation, a missing image, or a repeated id gives a
:class:`MathVisionProblem` whose ``error`` says what is wrong, and
:attr:`ProblemSet.n_errors` counts them.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from PIL import Image

__all__ = [
    "MathVisionProblem",
    "ProblemSet",
    "PyArrowMissing",
    "default_data_dir",
    "load_problems",
    "problems_from_records",
    "resolve_source",
]

LETTERS = "ABCDE"
SPLITS = ("testmini", "test")


class PyArrowMissing(ImportError):
    """Reading the parquet layout needs pyarrow."""


@dataclass
class MathVisionProblem:
    """One MathVision problem; ``error`` is set when the row is unusable."""

    id: str
    question: str = ""
    options: list[str] = field(default_factory=list)
    answer: str = ""
    solution: str | None = None
    level: int | None = None
    subject: str | None = None
    image: str | None = None  # the row's image reference (relative path)
    image_path: Path | None = None  # resolved file (JSONL layout)
    image_bytes: bytes | None = field(default=None, repr=False)  # parquet layout
    error: str | None = None

    @property
    def is_multiple_choice(self) -> bool:
        return len(self.options) > 0

    def load_image(self):
        """The problem's image as an RGB ``PIL.Image`` (raises if unavailable)."""

        if self.image_bytes is not None:
            img = Image.open(io.BytesIO(self.image_bytes))
        elif self.image_path is not None:
            img = Image.open(self.image_path)
        else:
            raise FileNotFoundError(f"problem {self.id}: no image")
        img.load()
        return img.convert("RGB")

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "question": self.question,
            "options": list(self.options),
            "answer": self.answer,
            "solution": self.solution,
            "level": self.level,
            "subject": self.subject,
            "image": self.image,
        }


@dataclass
class ProblemSet:
    """Problems in file order, including the ones carrying an ``error``."""

    problems: list[MathVisionProblem]
    source: str = ""

    def __iter__(self) -> Iterator[MathVisionProblem]:
        return iter(self.problems)

    def __len__(self) -> int:
        return len(self.problems)

    def __getitem__(self, index):
        return self.problems[index]

    @property
    def errors(self) -> list[tuple[str, str]]:
        """``(id, error)`` of every problem that is unusable."""
        return [(p.id, p.error) for p in self.problems if p.error]

    @property
    def n_errors(self) -> int:
        return sum(1 for p in self.problems if p.error)

    def by_id(self) -> dict[str, MathVisionProblem]:
        """id -> problem (the first row wins for a repeated id)."""
        out: dict[str, MathVisionProblem] = {}
        for p in self.problems:
            out.setdefault(p.id, p)
        return out

    def head(self, n: int | None) -> "ProblemSet":
        return self if n is None else ProblemSet(self.problems[: max(n, 0)], self.source)


# --------------------------------------------------------------------------
# row validation
# --------------------------------------------------------------------------


def _as_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return None


def _image_bytes(value: Any) -> bytes | None:
    """``decoded_image`` as stored by ``datasets``: a struct or raw bytes."""
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, Mapping):
        raw = value.get("bytes")
        if isinstance(raw, (bytes, bytearray, memoryview)):
            return bytes(raw)
    return None


def _problem_from_row(
    row: Any,
    where: str,
    images_root: Path | None,
    require_images: bool,
) -> MathVisionProblem:
    if not isinstance(row, Mapping):
        return MathVisionProblem(id=where, error=f"{where}: not a JSON object")

    raw_id = row.get("id")
    pid = _as_text(raw_id)
    problems: list[str] = []
    if pid is None or not pid.strip():
        problems.append("missing 'id'")
        pid = where
    prob = MathVisionProblem(id=pid)

    question = row.get("question")
    if isinstance(question, str):
        prob.question = question
    else:
        problems.append("'question' is not a string")

    answer = _as_text(row.get("answer"))
    if answer is None or not answer.strip():
        problems.append("missing 'answer'")
    else:
        prob.answer = answer

    options = row.get("options", [])
    if options is None:
        options = []
    if not isinstance(options, (list, tuple)) or not all(isinstance(o, str) for o in options):
        problems.append("'options' is not a list of strings")
    elif len(options) not in (0, len(LETTERS)):
        problems.append(f"'options' has {len(options)} entries (expected 0 or 5)")
    else:
        prob.options = list(options)
        if options and answer is not None and answer not in LETTERS:
            problems.append(f"multiple-choice answer {answer!r} is not a letter A-E")

    level = row.get("level")
    try:
        level_int = int(level)  # type: ignore[arg-type]
        if isinstance(level, bool) or float(level) != level_int:  # type: ignore[arg-type]
            raise ValueError
        prob.level = level_int
    except (TypeError, ValueError):
        problems.append(f"'level' is not an integer: {level!r}")

    subject = row.get("subject")
    if isinstance(subject, str) and subject:
        prob.subject = subject
    else:
        problems.append("missing 'subject'")

    solution = row.get("solution")
    prob.solution = solution if isinstance(solution, str) else None

    image = row.get("image")
    prob.image = image if isinstance(image, str) else None
    prob.image_bytes = _image_bytes(row.get("decoded_image"))
    if prob.image_bytes is None and prob.image:
        base = images_root if images_root is not None else Path(".")
        prob.image_path = base / prob.image
    if require_images and prob.image_bytes is None:
        if prob.image_path is None:
            problems.append("no image (neither 'decoded_image' bytes nor an 'image' path)")
        elif not prob.image_path.is_file():
            problems.append(f"image not found: {prob.image_path}")

    if problems:
        prob.error = f"{where}: " + "; ".join(problems)
    return prob


def problems_from_records(
    records: Iterable[Any],
    *,
    images_root: str | os.PathLike | None = None,
    require_images: bool = True,
    source: str = "",
    where_prefix: str = "row",
) -> ProblemSet:
    """Validate already-parsed rows (dicts) into a :class:`ProblemSet`."""
    root = Path(images_root) if images_root is not None else None
    out: list[MathVisionProblem] = []
    first_seen: dict[str, str] = {}
    for n, row in enumerate(records, 1):
        where = f"{where_prefix} {n}"
        prob = _problem_from_row(row, where, root, require_images)
        _mark_duplicate(prob, where, first_seen)
        out.append(prob)
    return ProblemSet(out, source)


def _mark_duplicate(prob: MathVisionProblem, where: str, first_seen: dict[str, str]) -> None:
    if prob.id in first_seen:
        msg = f"{where}: repeated id {prob.id!r} (first at {first_seen[prob.id]})"
        prob.error = f"{prob.error}; {msg}" if prob.error else msg
    else:
        first_seen[prob.id] = where


# --------------------------------------------------------------------------
# readers
# --------------------------------------------------------------------------


def _read_jsonl(path: Path, images_root: Path | None, require_images: bool) -> ProblemSet:
    root = images_root if images_root is not None else path.parent
    out: list[MathVisionProblem] = []
    first_seen: dict[str, str] = {}
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path.name}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                out.append(MathVisionProblem(id=where, error=f"{where}: invalid JSON ({exc.msg})"))
                continue
            prob = _problem_from_row(row, where, root, require_images)
            _mark_duplicate(prob, where, first_seen)
            out.append(prob)
    return ProblemSet(out, str(path))


def _import_pyarrow_parquet():
    try:
        import pyarrow.parquet as pq  # type: ignore
    except ImportError as exc:
        raise PyArrowMissing(
            "reading the Hugging Face parquet layout of MathVision needs pyarrow: "
            "pip install pyarrow  (or convert the data to JSONL + an images folder)"
        ) from exc
    return pq


def _read_parquet(paths: Sequence[Path], images_root: Path | None, require_images: bool) -> ProblemSet:
    pq = _import_pyarrow_parquet()
    out: list[MathVisionProblem] = []
    first_seen: dict[str, str] = {}
    for path in paths:
        root = images_root if images_root is not None else path.parent
        rows = pq.read_table(str(path)).to_pylist()
        for n, row in enumerate(rows, 1):
            where = f"{path.name}#{n}"
            prob = _problem_from_row(row, where, root, require_images)
            _mark_duplicate(prob, where, first_seen)
            out.append(prob)
    return ProblemSet(out, ", ".join(str(p) for p in paths))


def resolve_source(path: str | os.PathLike, split: str = "testmini") -> tuple[str, list[Path]]:
    """Which files ``path`` stands for: ``("jsonl", [file])`` or ``("parquet", files)``.

    ``path`` is a ``.jsonl`` file, a ``.parquet`` file, or a folder holding
    ``{split}.jsonl`` or ``{split}-*.parquet`` / ``{split}.parquet`` (directly
    or under ``data/``, as in the Hugging Face repository).
    """
    p = Path(path)
    if p.is_file():
        if p.suffix == ".parquet":
            return "parquet", [p]
        return "jsonl", [p]
    if not p.is_dir():
        raise FileNotFoundError(f"MathVision data not found: {p}")
    for folder in (p, p / "data"):
        jsonl = folder / f"{split}.jsonl"
        if jsonl.is_file():
            return "jsonl", [jsonl]
        parquet = sorted(folder.glob(f"{split}-*.parquet")) + sorted(folder.glob(f"{split}.parquet"))
        if parquet:
            return "parquet", parquet
    raise FileNotFoundError(
        f"no {split}.jsonl or {split}[-*].parquet in {p} (or {p / 'data'})"
    )


def load_problems(
    path: str | os.PathLike,
    *,
    split: str = "testmini",
    images_root: str | os.PathLike | None = None,
    require_images: bool = True,
    limit: int | None = None,
) -> ProblemSet:
    """Load MathVision problems from a JSONL file, parquet file(s) or a folder.

    ``images_root``: folder the JSONL ``image`` paths are relative to
    (default: the JSONL's folder).  ``require_images=False`` skips the image
    checks (enough for scoring, where only answers matter).  ``limit`` keeps
    the first N rows.
    """
    kind, files = resolve_source(path, split)
    root = Path(images_root) if images_root is not None else None
    if kind == "parquet":
        data = _read_parquet(files, root, require_images)
    else:
        data = _read_jsonl(files[0], root, require_images)
    return data.head(limit)


def default_data_dir(start: str | os.PathLike | None = None) -> Path | None:
    """``$VLM_KV_MATHVISION_DATA``, else the first ``shared/data/mathvision``
    found in ``start`` (default: the working directory) or one of its parents."""
    env = os.environ.get("VLM_KV_MATHVISION_DATA")
    if env:
        return Path(env)
    here = Path(start) if start is not None else Path.cwd()
    for folder in (here, *here.resolve().parents):
        candidate = folder / "shared" / "data" / "mathvision"
        if candidate.is_dir():
            return candidate
    return None
