"""Rule-based answer extraction and scoring for MathVision (MATH-Vision).

This re-implements, in our own code, the behaviour of the benchmark authors'
evaluator (``evaluation/evaluate.py`` + ``evaluation/utils.py`` of
mathllm/MATH-V), so that scores computed here are directly comparable to the
published ones.  The steps (numbered as in ``shared/specs/eval-mathvision.md``):

1. single-letter shortcuts ("... B." / "(C)\\n..." and so on);
2. a trailing number after the last ``"is "``;
3. cutting at the answer phrases ("the answer is", ...) when no ``\\boxed{`` is
   present, or keeping only the last ``\\boxed{`` when there are several;
4. normalisation (:func:`normalize_answer`, the authors' ``find_math_answer``
   followed by the MATH-dataset string cleanup), then letter unwrapping;
5. equality (:func:`is_equal`): exact string, tuple/list element-wise, then
   numeric comparison (2 decimals) of both sides parsed as LaTeX with
   ``latex2sympy2``;
6. aggregation in the authors' result format (:func:`aggregate`).

Quirks of the reference are kept on purpose (for instance the ``\frac12`` fix-up
only running when the string also contains "sqrt", or a bare ``e`` never
equalling 2.72 because sympy prints Euler's number as ``E``, a name the
reference's ``eval`` namespace lacks): they change verdicts, and the point of
this module is to reproduce the authors' verdicts.  On the three published
reference outputs (3 x 3040 responses) every stored verdict is reproduced
except one (Gemini-Pro, problem 3013, see the tests), which the published
evaluator itself does not give.  One deliberate departure: a power tower whose
value would need an integer of more than 2**22 bits (``9^{9^{9}}``) is not
evaluated (the reference would hang on it); it compares as not equal.

``latex2sympy2`` is an optional dependency (the ``eval`` extra).  Without it,
step 5 falls back to plain number / simple fraction comparison and a warning is
emitted once; scores are then only approximately the authors'.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import re
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Iterable, Mapping, Sequence

__all__ = [
    "ANSWER_PHRASES",
    "ScoredItem",
    "ScoreReport",
    "aggregate",
    "extract_answer",
    "format_ratio",
    "have_latex2sympy",
    "is_equal",
    "normalize_answer",
    "option_value",
    "score_item",
    "score_responses",
]

LETTERS = "ABCDE"

#: Answer phrases of step 3, tried in this order (lower-case, then capitalised).
ANSWER_PHRASES = (
    "the final answer is",
    "the answer is",
    "the correct answer is",
    "the answer should be",
)


# --------------------------------------------------------------------------
# optional latex2sympy2 backend
# --------------------------------------------------------------------------

_LATEX2SYMPY: Any = None
_LATEX2SYMPY_STATE = "unknown"  # "unknown" | "ok" | "missing"
_FALLBACK_WARNED = False


def _latex_parser():
    """Return ``latex2sympy2.latex2sympy`` or None (imported lazily, once)."""
    global _LATEX2SYMPY, _LATEX2SYMPY_STATE
    if _LATEX2SYMPY_STATE == "unknown":
        try:
            from latex2sympy2 import latex2sympy  # type: ignore

            _LATEX2SYMPY = latex2sympy
            _LATEX2SYMPY_STATE = "ok"
        except Exception:  # ImportError, or a broken antlr runtime
            _LATEX2SYMPY = None
            _LATEX2SYMPY_STATE = "missing"
    return _LATEX2SYMPY


def have_latex2sympy() -> bool:
    """True when the symbolic equality backend (``latex2sympy2``) is usable."""
    return _latex_parser() is not None


def _warn_fallback_once() -> None:
    global _FALLBACK_WARNED
    if not _FALLBACK_WARNED:
        _FALLBACK_WARNED = True
        warnings.warn(
            "latex2sympy2 is not importable: MathVision equality falls back to "
            "string / plain-number comparison, so scores may differ from the "
            "authors' (install it with `pip install latex2sympy2` or the "
            "`eval` extra)",
            RuntimeWarning,
            stacklevel=3,
        )


# The reference evaluates ``str(sympy_expr)`` with Python's ``eval`` inside a
# module that did ``from math import *``; so exactly the public names of the
# ``math`` module resolve (``pi``, ``e``, ``sqrt``, ``log``...), while sympy
# spellings such as ``E``, ``I``, ``oo`` or free symbols raise and make the
# comparison false.  No builtins are exposed: sympy never prints them.
_EVAL_NAMES: dict[str, Any] = {
    name: getattr(math, name) for name in dir(math) if not name.startswith("_")
}


class _EvalFailed(Exception):
    pass


# Integers above this many bits are not built (see _huge_power): the reference would spend
# minutes or all memory on them, and no MathVision answer is anywhere near that large.
_MAX_INTEGER_BITS = 1 << 22


def _lower_log2(expr: Any) -> float | None:
    """Lower bound of log2(value) when ``expr`` is built from positive integers with
    +, * and powers; None for anything else."""
    if getattr(expr, "is_Integer", False):
        return math.log2(int(expr)) if expr > 0 else None
    args = getattr(expr, "args", ())
    if getattr(expr, "is_Pow", False) and len(args) == 2:
        base, exp = (_lower_log2(a) for a in args)
        if base is None or exp is None:
            return None
        return base * (math.inf if exp > 1000 else 2.0 ** exp)
    if getattr(expr, "is_Mul", False) or getattr(expr, "is_Add", False):
        bounds = [_lower_log2(a) for a in args]
        if not bounds or any(b is None for b in bounds):
            return None
        return sum(bounds) if expr.is_Mul else max(bounds)
    return None


def _huge_power(expr: Any) -> bool:
    """True if evaluating ``expr`` as Python integers needs an integer of more than
    ``_MAX_INTEGER_BITS`` bits (e.g. ``9^{9^{9}}``)."""
    try:
        from sympy import preorder_traversal

        for node in preorder_traversal(expr):
            if getattr(node, "is_Pow", False) and getattr(node.args[0], "is_Integer", False):
                if abs(int(node.args[0])) < 2:
                    continue
                exp_bits = _lower_log2(node.args[1])
                if exp_bits is None:
                    continue
                bits = math.log2(abs(int(node.args[0]))) * (math.inf if exp_bits > 1000 else 2.0 ** exp_bits)
                if bits > _MAX_INTEGER_BITS:
                    return True
    except Exception:  # the guard must never change a verdict by itself failing
        return False
    return False


@lru_cache(maxsize=65536)
def _numeric_value_cached(text: str) -> tuple[bool, Any]:
    parser = _latex_parser()
    try:
        if parser is not None:
            expr = parser(text)
            if _huge_power(expr):
                return False, None
            expr_text = str(expr)
            value = eval(expr_text, {"__builtins__": {}}, dict(_EVAL_NAMES))  # noqa: S307
        else:
            value = _fallback_number(text)
        return True, round(value, 2)
    except Exception:  # any parse / evaluation / rounding failure
        return False, None


def _numeric_value(text: str) -> Any:
    """Value of ``text`` read as LaTeX math, rounded to 2 decimals.

    Raises :class:`_EvalFailed` when it cannot be evaluated to a number.
    """
    if _latex_parser() is None:
        _warn_fallback_once()
    ok, value = _numeric_value_cached(text)
    if not ok:
        raise _EvalFailed(text)
    return value


_FRAC_RE = re.compile(r"^(-?)\\frac\{([^{}]+)\}\{([^{}]+)\}$")


def _fallback_number(text: str) -> float:
    """Minimal numeric reader used only when latex2sympy2 is missing."""
    s = text.strip()
    try:
        return float(s)
    except ValueError:
        pass
    m = _FRAC_RE.match(s)
    if m:
        sign = -1.0 if m.group(1) else 1.0
        return sign * float(m.group(2)) / float(m.group(3))
    if s.count("/") == 1:
        num, den = s.split("/")
        return float(num) / float(den)
    raise ValueError(f"not a plain number: {text!r}")


def _clear_caches() -> None:
    """Forget cached evaluations (used by tests that swap the backend)."""
    _numeric_value_cached.cache_clear()


# --------------------------------------------------------------------------
# step 4: normalisation
# --------------------------------------------------------------------------

_BOXED_RE = re.compile(r"oxed{(.*)}", flags=re.S)


def _brace_sqrt_args(s: str) -> str:
    """``\\sqrt3`` -> ``\\sqrt{3}`` (only the first character is wrapped)."""
    head, *pieces = s.split("\\sqrt")
    out = [head]
    for piece in pieces:
        if piece and piece[0] != "{":
            out.append("\\sqrt{" + piece[0] + "}" + piece[1:])
        else:
            out.append("\\sqrt" + piece)
    return "".join(out)


def _brace_frac_args(s: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``; returns ``s`` unchanged if malformed."""
    head, *pieces = s.split("\\frac")
    out = [head]
    for piece in pieces:
        out.append("\\frac")
        if piece.startswith("{"):
            out.append(piece)
            continue
        if len(piece) < 2:
            return s
        num, den, rest = piece[0], piece[1], piece[2:]
        if den == "{":
            out.append("{" + num + "}" + den + rest)
        else:
            out.append("{" + num + "}{" + den + "}" + rest)
    return "".join(out)


def _slash_to_frac(s: str) -> str:
    """``"3/4"`` -> ``\\frac{3}{4}`` for a canonical integer ratio only."""
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        num, den = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    if s != f"{num}/{den}":
        return s
    return "\\frac{" + str(num) + "}{" + str(den) + "}"


def _math_cleanup(s: str) -> str:
    """The MATH-dataset string cleanup, as the reference applies it."""
    for old, new in (
        ("\n", ""),
        ("\\!", ""),
        ("\\\\", "\\"),
        ("tfrac", "frac"),
        ("dfrac", "frac"),
        ("\\left", ""),
        ("\\right", ""),
        ("^{\\circ}", ""),
        ("^\\circ", ""),
        ("\\$", ""),
        ("$", ""),
    ):
        s = s.replace(old, new)
    s = s.split("\\text{ ")[0]  # drop units written as "\text{ cm}"
    s = s.replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    # only a single "=" / "\approx" is split here (the caller already cut)
    if s.count("=") == 1:
        s = s.split("=")[1]
    if s.count("\\approx") == 1:
        s = s.split("\\approx")[1]
    if "sqrt" in s:
        s = _brace_sqrt_args(s)
    s = s.replace(" ", "")
    if "sqrt" in s:  # sic: the reference fixes \frac only next to a sqrt
        s = _brace_frac_args(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_to_frac(s)


def normalize_answer(text: str) -> str:
    """Normalise a candidate answer (the authors' ``find_math_answer``)."""
    s = text.lower()
    s = s.replace("{}", "")
    boxed = _BOXED_RE.findall(s)
    ans = boxed[-1] if boxed else s
    close, open_ = ans.find("}"), ans.find("{")
    if close != -1 and (open_ == -1 or close < open_):
        ans = ans.split("}")[0]
    ans = ans.split("=")[-1]
    ans = ans.split("\\approx")[-1]
    for old, new in (
        (" ", ""),
        ("\\,", ""),
        ("∞", "\\infty"),
        ("+\\infty", "\\infty"),
        ("\\\\", "\\"),
        ("\n", ""),
        ("\\text", ""),
        ("\\mbox", ""),
        ("bmatrix", "pmatrix"),
        ("\\left", ""),
        ("\\right", ""),
        ("^{\\circ}", ""),
        ("^\\circ", ""),
        ("{m}^3", ""),
        ("m^3", ""),
        ("{units}", ""),
        ("units", ""),
        ("{km}", ""),
        ("km", ""),
    ):
        ans = ans.replace(old, new)
    return _math_cleanup(ans)


def _unwrap_letter(s: str) -> str:
    for letter in "abcde":
        s = s.replace(f"({letter})", letter)
    for letter in "abcde":
        s = s.replace("{" + letter + "}", letter)
    return s.rstrip(".").lstrip(":").strip()


# --------------------------------------------------------------------------
# steps 1-4: extraction
# --------------------------------------------------------------------------


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _cut_at_phrase(s: str, phrase: str) -> str:
    had_phrase = phrase in s
    s = s.split(phrase)[-1].strip()
    if had_phrase:
        s = s.split("\n")[0].split(". ")[0]
    return s


def _pre_extract(response: str) -> str:
    """Steps 1-3 (before normalisation)."""
    a = response.strip()
    # step 1: bare letter answers
    for c in LETTERS:
        if (
            a.endswith(f" {c}.")
            or a.endswith(f" ({c}).")
            or a.startswith(f"{c}\n")
            or a.startswith(f"({c})\n")
            or a.startswith(f"({c}) {c}\n")
        ):
            a = c
    # step 2: "... is 42."
    tail = a.split("is ")[-1].rstrip(".")
    if _is_float(tail):
        a = tail
    # step 3: answer phrases, or the last of several boxes
    if "oxed{" not in a:
        for phrase in ANSWER_PHRASES:
            a = _cut_at_phrase(a, phrase)
            a = _cut_at_phrase(a, phrase.replace("the", "The"))
    elif a.count("oxed{") > 1:
        a = "\\boxed{" + a.split("oxed{")[-1]
    return a


def extract_answer(response: str) -> str:
    """Extract and normalise the final answer from a raw model response."""
    return _unwrap_letter(normalize_answer(_pre_extract(response)))


# --------------------------------------------------------------------------
# step 5: equality
# --------------------------------------------------------------------------


def _evaluate_sequence(s: str) -> str:
    """``"(2*3, 5+2)"`` -> ``"(6,7)"``; anything else is returned unchanged."""
    if not s:
        return s
    inner = s[1:-1].split(",")
    if len(inner) < 2:
        return s
    if s[0] == "(" and s[-1] == ")":
        left, right = "(", ")"
    elif s[0] == "[" and s[-1] == "]":
        left, right = "[", "]"
    else:
        return s
    items = []
    try:
        for item in inner:
            if "infty" in item or item in ("a", "-a"):
                items.append(item)
            else:
                items.append(str(_numeric_value(item)))
    except _EvalFailed:
        return s
    return left + ",".join(items) + right


def is_equal(a: str, b: str) -> bool:
    """The authors' answer equality (symmetric; case-insensitive)."""
    a = a.lower()
    b = b.lower()
    if not a.replace(" ", "") or not b.replace(" ", ""):
        return False
    if a.strip() == b.strip():
        return True
    a = _evaluate_sequence(a)
    b = _evaluate_sequence(b)
    if a == b:
        return True
    # Both sides must evaluate; ``a`` (the reference side in our callers) is
    # tried first so that a non-numeric reference skips parsing the candidate.
    try:
        value_a = _numeric_value(a)
        return value_a == _numeric_value(b)
    except _EvalFailed:
        return False


def option_value(answer: str, options: Sequence[str]) -> str:
    """Text of the option the ground-truth letter points to ('' if none)."""
    if not options:
        return ""
    idx = ord(answer) - ord("A") if len(answer) == 1 else -1
    if 0 <= idx < len(options):
        return str(options[idx])
    return ""


def score_item(response: str, answer: str, options: Sequence[str] = ()) -> tuple[str, bool]:
    """Return ``(extracted_answer, correct)`` for one raw response."""
    extracted = extract_answer(response)
    gt = str(answer)
    correct = is_equal(gt, extracted) or is_equal(option_value(gt, options), extracted)
    return extracted, bool(correct)


# --------------------------------------------------------------------------
# step 6: aggregation
# --------------------------------------------------------------------------


def format_ratio(correct: int, total: int) -> str:
    """``"384/3040=12.63%"`` (Python's float repr of the rounded percentage)."""
    if total == 0:
        return f"{correct}/{total}=0"
    return f"{correct}/{total}={round(correct / total * 100, 2)}%"


def aggregate(records: Iterable[tuple[Any, str, bool]]) -> dict[str, str]:
    """Accuracy in the authors' result format.

    ``records`` yields ``(level, subject, correct)``.  Keys: ``-all``,
    ``-level{L}``, ``-level{L}_{subject}``, ``{subject}``,
    ``{subject}_level{L}``, present only when they have at least one item, in
    sorted order (which puts the ``-`` keys first), as the authors write them.
    """
    counts: dict[str, list[int]] = {}
    for level, subject, correct in records:
        for key in (
            "-all",
            f"-level{level}",
            f"{subject}",
            f"{subject}_level{level}",
            f"-level{level}_{subject}",
        ):
            slot = counts.setdefault(key, [0, 0])
            slot[0] += 1 if correct else 0
            slot[1] += 1
    return {key: format_ratio(*counts[key]) for key in sorted(counts)}


# --------------------------------------------------------------------------
# scoring a whole responses file
# --------------------------------------------------------------------------


@dataclass
class ScoredItem:
    id: str
    response: str | None
    extracted: str | None
    correct: bool
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "response": self.response,
            "extracted": self.extracted,
            "correct": self.correct,
            "error": self.error,
        }


@dataclass
class ScoreReport:
    items: list[ScoredItem] = field(default_factory=list)
    result: dict[str, str] = field(default_factory=dict)
    n_errors: int = 0
    #: ids of problems that had no response row (not part of ``result``)
    missing: list[str] = field(default_factory=list)

    @property
    def n_correct(self) -> int:
        return sum(1 for it in self.items if it.correct)


def score_responses(
    problems: Mapping[str, Any] | Iterable[Any],
    responses: Iterable[Mapping[str, Any]],
    workers: int = 1,
) -> ScoreReport:
    """Re-extract and re-judge every response row.

    ``problems`` maps id -> problem (or is an iterable of problems); a problem
    is a :class:`~vlm_kv.eval.mathvision_data.MathVisionProblem` or a dict with
    ``answer``, ``options``, ``level`` and ``subject``.  Stored verdicts
    (``correct`` / ``model_answer`` / ``extracted``) in the rows are ignored.

    Problem rows are never dropped silently.  A row that carries an
    ``error`` (for instance a failed generation), has no string
    ``response``, or points at a problem that itself failed to load, counts
    as incorrect with its ``error`` set.  Rows that cannot be placed in the
    aggregate (no id, an id unknown to ``problems``, or a repeated id) are
    kept in ``items`` with an error but left out of ``result``.  All of them
    are counted in ``n_errors``.

    ``workers > 1`` scores in that many processes (parsing LaTeX with
    latex2sympy2 is slow; verdicts do not depend on the worker count).
    """
    if isinstance(problems, Mapping):
        by_id = {str(k): v for k, v in problems.items()}
    else:
        by_id = {str(_field(p, "id")): p for p in problems}

    report = ScoreReport()
    placed: list[Any] = []  # problem of each item, or None when not aggregated
    jobs: list[tuple[int, str, str, list[str]]] = []
    seen: set[str] = set()
    for row in responses:
        if not isinstance(row, Mapping) or row.get("id") is None:
            report.items.append(ScoredItem("", None, None, False, error="response row without an id"))
            placed.append(None)
            continue
        rid = str(row["id"])
        response = row.get("response")
        text = response if isinstance(response, str) else None
        problem = by_id.get(rid)
        if problem is None:
            report.items.append(ScoredItem(rid, text, None, False,
                                           error=f"id {rid!r} is not among the problems"))
            placed.append(None)
            continue
        if rid in seen:
            report.items.append(ScoredItem(rid, text, None, False,
                                           error=f"repeated id {rid!r} (only the first row counts)"))
            placed.append(None)
            continue
        seen.add(rid)
        problem_error = _field(problem, "error")
        if problem_error:
            error: str | None = f"problem: {problem_error}"
        elif row.get("error"):
            error = str(row["error"])
        elif text is None:
            error = "missing or non-string 'response'"
        else:
            error = None
        if text is not None and not problem_error:
            jobs.append((len(report.items), text, str(_field(problem, "answer")),
                         [str(o) for o in (_field(problem, "options") or [])]))
        report.items.append(ScoredItem(rid, text, None, False, error))
        placed.append(problem)

    for index, extracted, correct, error in _run_jobs(jobs, workers):
        item = report.items[index]
        item.extracted, item.correct = extracted, correct
        if error and not item.error:
            item.error = error

    report.n_errors = sum(1 for it in report.items if it.error)
    report.result = aggregate(
        (_field(p, "level"), _field(p, "subject"), it.correct)
        for it, p in zip(report.items, placed)
        if p is not None
    )
    report.missing = [pid for pid in by_id if pid not in seen]
    return report


def _score_jobs(jobs: list[tuple[int, str, str, list[str]]]) -> list[tuple[int, str | None, bool, str | None]]:
    out = []
    for index, response, answer, options in jobs:
        try:
            extracted, correct = score_item(response, answer, options)
            out.append((index, extracted, correct, None))
        except Exception as exc:  # defensive: scoring must never stop a run
            out.append((index, None, False, f"scoring failed: {type(exc).__name__}: {exc}"))
    return out


def _run_jobs(jobs, workers: int):
    if workers <= 1 or len(jobs) < 2 * max(workers, 1):
        return _score_jobs(jobs)

    # fork keeps the already-imported modules (and is much cheaper than
    # re-importing the package); fall back to the platform default elsewhere
    _latex_parser()  # import (and build the parser tables) once, before forking
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else None)
    chunk = 32
    chunks = [jobs[i:i + chunk] for i in range(0, len(jobs), chunk)]
    out: list = []
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        for part in pool.map(_score_jobs, chunks):
            out.extend(part)
    return out


def _field(obj: Any, name: str) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def read_jsonl_rows(path) -> tuple[list[dict[str, Any]], list[str]]:
    """Read a JSONL file leniently: ``(rows, errors)``; bad lines become errors."""
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                errors.append(f"line {lineno}: invalid JSON ({exc.msg})")
                continue
            if not isinstance(obj, dict):
                errors.append(f"line {lineno}: not a JSON object")
                continue
            rows.append(obj)
    return rows, errors
