"""MMDU benchmark loading (multi-turn, multi-image dialogs).

The benchmark file is a JSON object keyed by dialog id. Each value holds ``id``, ``image`` (a list
of image paths) and ``conversations``: alternating ``{"from": "user" | "assistant", "value": str}``
entries. User turns carry ``<ImageHere>`` tags; the dialog's images are consumed in order across
turns (a turn with n tags takes the next n images).

Nothing here crashes on a bad item. Problems are collected as :class:`Problem` records (dialog id,
turn, kind, detail) and counted per kind; every dialog and question of the file stays accounted
for: a question that cannot be run is kept with ``Turn.problem`` set, never dropped.

Turn-level rule: once a turn cannot be run (missing image, tag/image count mismatch, malformed
entry), it and every later turn of the same dialog are marked unrunnable, because later turns
would otherwise see a history that differs from the benchmark's. Earlier turns stay runnable.

Image path resolution (the archive's paths are often absolute paths of the authors' machines):
an entry is looked up, in order, as an existing absolute path, as ``root / path``, then as
``root / <trailing components of path>`` (longest first, down to the bare file name), and last
by its file name anywhere under ``root`` (only when that name is unique there).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

IMAGE_TAG = "<ImageHere>"

# Problem kinds (stable strings: they are counted and written to result files).
MISSING_IMAGE = "missing_image"
UNREADABLE_IMAGE = "unreadable_image"
TAG_COUNT_MISMATCH = "tag_image_count_mismatch"
MALFORMED_DIALOG = "malformed_dialog"
MALFORMED_TURN = "malformed_turn"
UNPAIRED_QUESTION = "unpaired_question"
BAD_FILE = "bad_file"


@dataclass
class Problem:
    dialog_id: str | None
    turn: int | None  # 0-based question index within the dialog; None for dialog-level problems
    kind: str
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {"dialog_id": self.dialog_id, "turn": self.turn, "kind": self.kind, "detail": self.detail}


@dataclass
class Turn:
    index: int  # 0-based question index in the dialog
    question: str  # the user text, <ImageHere> tags still in place
    reference: str | None  # the reference answer (never shown to the model)
    image_paths: list[str] = field(default_factory=list)  # resolved paths of this turn's images
    problem: str | None = None  # why this turn cannot be run (None: runnable)

    @property
    def runnable(self) -> bool:
        return self.problem is None


@dataclass
class Dialog:
    id: str
    turns: list[Turn]
    image_paths: list[str]  # resolved (or, when missing, raw) paths of all images, in order
    problems: list[Problem] = field(default_factory=list)

    @property
    def runnable_turns(self) -> list[Turn]:
        return [t for t in self.turns if t.runnable]

    @property
    def n_questions(self) -> int:
        return len(self.turns)


@dataclass
class MMDUData:
    path: str
    images_root: str
    dialogs: list[Dialog]
    problems: list[Problem]

    @property
    def n_dialogs(self) -> int:
        return len(self.dialogs)

    @property
    def n_questions(self) -> int:
        return sum(d.n_questions for d in self.dialogs)

    @property
    def n_runnable_questions(self) -> int:
        return sum(len(d.runnable_turns) for d in self.dialogs)

    def problem_counts(self) -> dict[str, int]:
        return dict(Counter(p.kind for p in self.problems))

    def summary(self) -> dict[str, Any]:
        return {
            "n_dialogs": self.n_dialogs,
            "n_questions": self.n_questions,
            "n_runnable_questions": self.n_runnable_questions,
            "n_unrunnable_questions": self.n_questions - self.n_runnable_questions,
            "problem_counts": self.problem_counts(),
        }


_NAME_INDEX: dict[str, dict[str, str | None]] = {}


def _name_index(root: Path) -> dict[str, str | None]:
    """File name -> path for every file under root (None where the name is not unique)."""
    key = str(root.resolve())
    if key not in _NAME_INDEX:
        index: dict[str, str | None] = {}
        for dirpath, _dirs, files in os.walk(root):
            for name in files:
                index[name] = None if name in index else os.path.join(dirpath, name)
        _NAME_INDEX[key] = index
    return _NAME_INDEX[key]


def resolve_image(path: str, root: str | os.PathLike | None) -> str | None:
    """The existing file an MMDU image entry points to, or None (see the module docstring)."""
    if not isinstance(path, str) or not path.strip():
        return None
    raw = path.strip()
    p = Path(raw)
    if p.is_absolute() and p.is_file():
        return str(p)
    if root is None:
        return str(p) if p.is_file() else None
    root = Path(root)
    parts = [x for x in Path(raw.replace("\\", "/")).parts if x not in ("/", ".", "")]
    # drop a Windows drive / anchor if any
    parts = [x for x in parts if not x.endswith(":") and x != "\\"]
    for start in range(len(parts)):
        cand = root.joinpath(*parts[start:])
        if cand.is_file():
            return str(cand)
    if parts and root.is_dir():
        return _name_index(root).get(parts[-1])
    return None


def _check_image_readable(path: str) -> str | None:
    """None if Pillow can identify the file, else the reason."""
    try:
        from PIL import Image

        with Image.open(path) as im:
            im.verify()
        return None
    except Exception as exc:  # noqa: BLE001 - any decoder error is a data problem
        return f"{type(exc).__name__}: {exc}"


def _parse_dialog(
    key: str, item: Any, root: str | None, verify_images: bool
) -> tuple[Dialog, list[Problem]]:
    problems: list[Problem] = []
    did = str(key)
    if not isinstance(item, dict):
        problems.append(Problem(did, None, MALFORMED_DIALOG, f"entry is a {type(item).__name__}, not an object"))
        return Dialog(did, [], []), problems
    if item.get("id") is not None:
        did = str(item["id"])
    images = item.get("image", [])
    if isinstance(images, str):
        images = [images]
    if not isinstance(images, list):
        problems.append(Problem(did, None, MALFORMED_DIALOG, "'image' is not a list"))
        images = []
    conv = item.get("conversations")
    if not isinstance(conv, list) or not conv:
        problems.append(Problem(did, None, MALFORMED_DIALOG, "'conversations' missing or empty"))
        return Dialog(did, [], [str(x) for x in images]), problems

    # Pair user turns with the assistant turn that follows. Anything out of order is a turn problem.
    pairs: list[tuple[Any, Any, str | None]] = []  # (question, reference, problem)
    i = 0
    while i < len(conv):
        entry = conv[i]
        role = entry.get("from") if isinstance(entry, dict) else None
        value = entry.get("value") if isinstance(entry, dict) else None
        if role != "user":
            # A stray assistant / unknown entry: reported; it belongs to no question.
            problems.append(
                Problem(did, None, MALFORMED_TURN, f"conversations[{i}] is not a user turn where one is due: {str(entry)[:80]}")
            )
            i += 1
            continue
        if not isinstance(value, str):
            # A user turn without text: kept as an unrunnable question (its reference is skipped).
            problems.append(Problem(did, len(pairs), MALFORMED_TURN, f"conversations[{i}] user value is not text"))
            pairs.append(("", None, MALFORMED_TURN))
            nxt = conv[i + 1] if i + 1 < len(conv) else None
            i += 2 if isinstance(nxt, dict) and nxt.get("from") == "assistant" else 1
            continue
        nxt = conv[i + 1] if i + 1 < len(conv) else None
        if isinstance(nxt, dict) and nxt.get("from") == "assistant":
            ref = nxt.get("value")
            if not isinstance(ref, str):
                problems.append(Problem(did, len(pairs), MALFORMED_TURN, "reference answer is not text"))
                pairs.append((value, None, MALFORMED_TURN))
            else:
                pairs.append((value, ref, None))
            i += 2
        else:
            problems.append(Problem(did, len(pairs), UNPAIRED_QUESTION, "user turn has no assistant reference after it"))
            pairs.append((value, None, UNPAIRED_QUESTION))
            i += 1

    resolved: list[str] = []
    image_problem: list[str | None] = []  # per image: None or problem kind
    for j, raw in enumerate(images):
        r = resolve_image(raw, root) if isinstance(raw, str) else None
        if r is None:
            resolved.append(str(raw))
            image_problem.append(MISSING_IMAGE)
            continue
        if verify_images:
            why = _check_image_readable(r)
            if why is not None:
                resolved.append(r)
                image_problem.append(UNREADABLE_IMAGE + ": " + why)
                continue
        resolved.append(r)
        image_problem.append(None)

    turns: list[Turn] = []
    cursor = 0
    blocked: str | None = None  # set once a turn is unrunnable: later turns follow
    for t, (q, ref, prob) in enumerate(pairs):
        n_tags = q.count(IMAGE_TAG)
        take = list(range(cursor, cursor + n_tags))
        cursor += n_tags
        turn = Turn(t, q, ref, [resolved[k] for k in take if k < len(resolved)])
        if prob is not None:
            turn.problem = prob
        elif take and take[-1] >= len(resolved):
            turn.problem = TAG_COUNT_MISMATCH
            problems.append(
                Problem(did, t, TAG_COUNT_MISMATCH, f"turn needs images {take[0]}..{take[-1]} but the dialog lists {len(resolved)}")
            )
        else:
            bad = [(k, image_problem[k]) for k in take if image_problem[k] is not None]
            if bad:
                kind = MISSING_IMAGE if bad[0][1] == MISSING_IMAGE else UNREADABLE_IMAGE
                turn.problem = kind
                for k, why in bad:
                    kk = MISSING_IMAGE if why == MISSING_IMAGE else UNREADABLE_IMAGE
                    detail = f"image {k} ({images[k]!s})" + ("" if why == MISSING_IMAGE else f": {why.split(': ', 1)[1]}")
                    problems.append(Problem(did, t, kk, detail))
        if turn.problem is None and blocked is not None:
            turn.problem = f"after_unrunnable_turn:{blocked}"
        if turn.problem is not None and blocked is None:
            blocked = f"{t}"
        turns.append(turn)
    if cursor < len(resolved):
        problems.append(
            Problem(did, None, TAG_COUNT_MISMATCH, f"{len(resolved) - cursor} image(s) listed but never referenced by a tag")
        )
    if not turns:
        problems.append(Problem(did, None, MALFORMED_DIALOG, "no questions"))
    return Dialog(did, turns, resolved, problems), problems


def load_mmdu(
    path: str | os.PathLike,
    images_root: str | os.PathLike | None = None,
    *,
    limit: int | None = None,
    verify_images: bool = False,
) -> MMDUData:
    """Load the MMDU benchmark JSON.

    ``images_root``: the folder the images archive was extracted to (default: the JSON's folder).
    ``limit``: keep the first N dialogs (file order). ``verify_images``: open every image with
    Pillow now (slower) instead of only checking that the file exists.
    A file that cannot be read or parsed yields an empty dataset with one ``bad_file`` problem.
    """
    path = str(path)
    _NAME_INDEX.clear()  # the file-name index is rebuilt per load (folders may have changed)
    root = str(images_root) if images_root is not None else str(Path(path).parent)
    problems: list[Problem] = []
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as exc:
        problems.append(Problem(None, None, BAD_FILE, f"{type(exc).__name__}: {exc}"))
        return MMDUData(path, root, [], problems)
    if isinstance(raw, list):  # tolerate a list of dialogs
        items = [(str(x.get("id", i)) if isinstance(x, dict) else str(i), x) for i, x in enumerate(raw)]
    elif isinstance(raw, dict):
        items = list(raw.items())
    else:
        problems.append(Problem(None, None, BAD_FILE, f"top level is a {type(raw).__name__}, not an object"))
        return MMDUData(path, root, [], problems)
    if limit is not None:
        items = items[: max(0, int(limit))]
    dialogs: list[Dialog] = []
    seen: Counter = Counter()
    for key, item in items:
        d, probs = _parse_dialog(key, item, root, verify_images)
        seen[d.id] += 1
        if seen[d.id] > 1:  # keep ids unique: results are keyed by dialog id
            new_id = f"{d.id}#{seen[d.id]}"
            probs.append(Problem(d.id, None, MALFORMED_DIALOG, f"duplicate dialog id; renamed to {new_id}"))
            for p in probs:
                p.dialog_id = new_id
            d.id = new_id
        dialogs.append(d)
        problems.extend(probs)
    return MMDUData(path, root, dialogs, problems)


def split_question(question: str) -> list[tuple[str, int | None]]:
    """Split a user turn at its <ImageHere> tags: [(text, None) | ("", k)] with k the tag's order."""
    out: list[tuple[str, int | None]] = []
    pieces = question.split(IMAGE_TAG)
    for k, piece in enumerate(pieces):
        if piece:
            out.append((piece, None))
        if k < len(pieces) - 1:
            out.append(("", k))
    return out
