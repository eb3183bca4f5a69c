"""MMDU judging: prompt, output parsing, aggregation, ROUGE-L, and a local judge model.

The judge compares the assistant's answer with the reference answer on six dimensions plus an
overall score (see ``JUDGE_INSTRUCTIONS``; written for this project, following the structure of
the MMDU protocol: explanations first, then a dict of integer scores).

Parsing rule (``parse_judge_output``): take the LAST ``{...}`` block of the reply (innermost
braces, i.e. without nested braces) that yields at least one numeric score for a known key.
Earlier dicts and later non-score brace blocks are ignored. Keys are matched case-, space-,
underscore- and punctuation-insensitively ("overall score", "OverallScore", "**Overall Score**",
"overall" all mean "Overall Score"). Values may be ints, floats or numeric strings ("7", "7/10");
they are clipped to [0, 10]. Non-numeric values count as missing. Single quotes, trailing commas,
markdown fences and surrounding prose are tolerated because values are read pair by pair.

Aggregation (``aggregate``): per key, the mean over ALL judged questions (a failed parse or a
missing key counts 0: "all") and over the questions where the key was parsed ("valid"), both
times 10 (0-100 scale), plus counts.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

DIMENSIONS: tuple[str, ...] = (
    "Creativity",
    "Richness",
    "Visual Perception",
    "Logical Coherence",
    "Answer Accuracy",
    "Image Relationship Understanding",
)
OVERALL = "Overall Score"
SCORE_KEYS: tuple[str, ...] = DIMENSIONS + (OVERALL,)

# ----------------------------------------------------------------------------- prompt

JUDGE_INSTRUCTIONS = """\
You are grading one reply of an AI assistant in a conversation about one or more images. Act as a \
fair, impartial and demanding judge. You are given the user's question, a reference answer \
written by experts, and the assistant's reply. Compare the assistant's reply with the reference \
answer on six dimensions - Creativity, Richness, Visual Perception, Logical Coherence, Answer \
Accuracy and Image Relationship Understanding - and then give an Overall Score.

Procedure:
1. For each dimension, first write a short assessment of the reply (its strengths and its \
weaknesses on that dimension), then give that dimension an integer score from 1 to 10.
2. Then give an integer Overall Score from 1 to 10 that follows from your assessments.
3. Be strict. Scores of 9 or 10 are reserved for a reply that is better than the reference \
answer on that dimension. A reply that does not serve what the user asked for scores low.

Scoring bands:

Creativity (originality and freshness of the content)
1-2: nothing original; generic or boilerplate content.
3-4: a little originality, but of poor quality.
5-6: fairly original without real novelty; average quality.
7-8: original ideas of high quality.
9-10: more original and insightful than the reference answer, of outstanding quality.

Richness (depth, breadth and variety of the information)
1-2: very little information; shallow and narrow.
3-4: thin coverage, few explanations or examples, little variety.
5-6: gives the essential information but stays limited in depth or breadth.
7-8: goes into depth and adds useful extra information.
9-10: deeper, broader and more varied than the reference answer.

Visual Perception (how faithfully the reply describes what the images show)
1-2: the description of the images is wrong or clearly contradicts them.
3-4: captures only a small part of the image content and contains some errors.
5-6: gets the basic image content right but says little about it.
7-8: matches the images well and describes them in rich detail.
9-10: matches the images and is more detailed and informative about them than the reference answer.

Logical Coherence (consistency and soundness of the reasoning)
1-2: incoherent, illogical, or unrelated to the question and the given information.
3-4: partly coherent, with many logical errors or contradictions.
5-6: mostly coherent with a few slips; may lose the thread in complex parts.
7-8: well reasoned with very few errors.
9-10: flawless reasoning that handles complexity better than the reference answer.

Answer Accuracy (correctness and completeness with respect to the question)
1-2: wrong, off the question, or full of obvious errors.
3-4: partly right, but with errors or large gaps.
5-6: essentially right but short on detail.
7-8: correct, detailed, and answers the question fully.
9-10: correct and detailed, and adds valuable information beyond the reference answer.

Image Relationship Understanding (telling the images apart and relating them to each other)
1-2: confuses the images or relates them wrongly.
3-4: tells the images apart only minimally, with errors or confusion; relations are unclear.
5-6: identifies and relates the images correctly at a basic level, with few details.
7-8: distinguishes and relates the images accurately and in detail, naming their main \
similarities and differences.
9-10: a fuller comparison than the reference answer, with richer analysis of how the images agree \
and differ.

Overall Score (the reply as a whole)
1-2: irrelevant, factually wrong, or harmful.
3-4: no serious errors and harmless, but of low quality and short of the request.
5-6: meets the request at a basic level but is weak on some dimensions.
7-8: good on every dimension.
9-10: answers the question and all its requirements completely, clearly better than the reference answer.

Write your explanations first and your scores after them. End your reply with a single Python \
dictionary, braces included, that holds all seven integer scores under exactly these keys:
{'Creativity': <score>, 'Richness': <score>, 'Visual Perception': <score>, 'Logical Coherence': \
<score>, 'Answer Accuracy': <score>, 'Image Relationship Understanding': <score>, 'Overall Score': <score>}
"""

QUESTION_HEADER = "[Question]"
REFERENCE_START = "[The Start of Reference Answer]"
REFERENCE_END = "[The End of Reference Answer]"
ANSWER_START = "[The Start of Assistant's Answer]"
ANSWER_END = "[The End of Assistant's Answer]"


def build_judge_prompt(question: str, reference: str, answer: str, instructions: str = JUDGE_INSTRUCTIONS) -> str:
    """The single user message sent to the judge for one question."""
    return (
        f"{instructions}\n"
        f"{QUESTION_HEADER}\n{question}\n\n"
        f"{REFERENCE_START}\n{reference}\n{REFERENCE_END}\n\n"
        f"{ANSWER_START}\n{answer}\n{ANSWER_END}"
    )


# ----------------------------------------------------------------------------- parsing


def _norm_key(key: str) -> str:
    return re.sub(r"[^a-z]", "", key.lower())


_KEY_MAP: dict[str, str] = {_norm_key(k): k for k in SCORE_KEYS}
_KEY_MAP.update({"overall": OVERALL, "overallscores": OVERALL, "overallrating": OVERALL})

_BRACES = re.compile(r"\{[^{}]*\}")
# key: "double quoted" | 'single quoted' | bare words; then ':' or '='; then an optional quote and a number
_PAIR = re.compile(
    r"""(?:"([^"\n]*)"|'([^'\n]*)'|([A-Za-z*_][A-Za-z *_\-]*?))\s*[:=]\s*["']?\s*([-+]?\d+(?:\.\d+)?)"""
)


@dataclass
class JudgeParse:
    """Scores found in one judge reply (None when nothing usable) and why parsing fell short."""

    scores: dict[str, float] | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Every one of the seven keys was found."""
        return self.scores is not None and all(k in self.scores for k in SCORE_KEYS)

    def to_dict(self) -> dict[str, Any]:
        return {"scores": self.scores, "parse_error": self.error}


def _clip(value: float) -> float:
    return min(10.0, max(0.0, value))


def _scores_in_block(block: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for m in _PAIR.finditer(block):
        raw_key = next(g for g in m.groups()[:3] if g is not None)
        key = _KEY_MAP.get(_norm_key(raw_key))
        if key is None:
            continue
        value = float(m.group(4))
        if not math.isfinite(value):
            continue
        found[key] = _clip(value)
    return found


def parse_judge_output(text: str | None) -> JudgeParse:
    """Scores of the last score dict in a judge reply; see the module docstring for the rules."""
    if text is None or not str(text).strip():
        return JudgeParse(None, "empty judge output")
    text = str(text)
    blocks = _BRACES.findall(text)
    if not blocks:
        if "{" in text:
            return JudgeParse(None, "no complete {...} dict (truncated output?)")
        return JudgeParse(None, "no {...} dict in judge output")
    for block in reversed(blocks):
        scores = _scores_in_block(block)
        if scores:
            missing = [k for k in SCORE_KEYS if k not in scores]
            error = f"missing keys: {', '.join(missing)}" if missing else None
            ordered = {k: scores[k] for k in SCORE_KEYS if k in scores}
            return JudgeParse(ordered, error)
    return JudgeParse(None, f"none of the {len(blocks)} {{...}} block(s) holds a numeric score for a known key")


# ----------------------------------------------------------------------------- aggregation


def aggregate(score_dicts: Sequence[Mapping[str, float] | None]) -> dict[str, Any]:
    """Benchmark numbers over judged questions.

    ``score_dicts``: one entry per judged question: its parsed scores (possibly missing some
    keys) or None when the reply could not be parsed. Returns ``all`` (missing = 0) and ``valid``
    (mean over questions where the key was parsed; None if none) per key, both x10, plus
    ``n_valid`` per key, ``n_judged``, ``n_parse_failures`` (no usable dict) and ``n_incomplete``
    (a dict missing at least one key).
    """
    n = len(score_dicts)
    sums = {k: 0.0 for k in SCORE_KEYS}
    counts = {k: 0 for k in SCORE_KEYS}
    failures = 0
    incomplete = 0
    for s in score_dicts:
        if s is None:
            failures += 1
            continue
        if any(k not in s or s[k] is None for k in SCORE_KEYS):
            incomplete += 1
        for k in SCORE_KEYS:
            v = s.get(k)
            if v is None:
                continue
            sums[k] += float(v)
            counts[k] += 1
    return {
        "n_judged": n,
        "n_parse_failures": failures,
        "n_incomplete": incomplete,
        "all": {k: (10.0 * sums[k] / n if n else None) for k in SCORE_KEYS},
        "valid": {k: (10.0 * sums[k] / counts[k] if counts[k] else None) for k in SCORE_KEYS},
        "n_valid": dict(counts),
    }


# ----------------------------------------------------------------------------- ROUGE-L

_TOKEN = re.compile(r"\w+", re.UNICODE)


def rouge_tokens(text: str | None) -> list[str]:
    """Lower-cased word tokens: text split at whitespace and punctuation (punctuation dropped)."""
    return _TOKEN.findall((text or "").lower())


def lcs_length(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the longest common subsequence (bit-parallel; O(len(a) * len(b) / wordsize))."""
    if not a or not b:
        return 0
    if len(a) < len(b):  # the bit vector runs over the shorter sequence's complement
        a, b = b, a
    # bit i of masks[x] is set where b[i] == x
    masks: dict[Any, int] = {}
    for i, x in enumerate(b):
        masks[x] = masks.get(x, 0) | (1 << i)
    full = (1 << len(b)) - 1
    v = full
    for x in a:
        m = masks.get(x)
        if m is None:
            continue
        u = v & m
        v = ((v + u) | (v - u)) & full
    return len(b) - bin(v).count("1")


def rouge_l(candidate: str | None, reference: str | None) -> float:
    """ROUGE-L F-measure (beta = 1) between two texts, in [0, 1]; 0 when either is empty."""
    c = rouge_tokens(candidate)
    r = rouge_tokens(reference)
    lcs = lcs_length(c, r)
    if lcs == 0:
        return 0.0
    p = lcs / len(c)
    rec = lcs / len(r)
    return 2 * p * rec / (p + rec)


# ----------------------------------------------------------------------------- local judge


class LocalJudge:
    """A transformers chat model loaded from a local folder, judging greedily and text-only.

    This is the VLMEvalKit-style protocol (the judge sees no images); the MMDU authors used
    GPT-4o with the dialog's images, so scores from a different judge are not comparable with
    published numbers. ``info()`` says which judge ran.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        device: str | None = None,
        dtype: Any = "auto",
        max_new_tokens: int = 1024,
    ):
        self.path = os.path.abspath(str(path))
        if not os.path.isdir(self.path):
            raise FileNotFoundError(f"judge model folder not found: {self.path}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if dtype == "auto" and str(device).startswith("cpu"):
            dtype = torch.float32
        self.device = device
        self.max_new_tokens = int(max_new_tokens)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=dtype)
        self.model.to(device)
        self.model.eval()
        self.has_chat_template = bool(getattr(self.tokenizer, "chat_template", None))
        cfg = self.model.config
        self.name = os.path.basename(self.path.rstrip(os.sep)) or self.path
        self.model_type = getattr(cfg, "model_type", None)

    def info(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": self.path,
            "model_type": self.model_type,
            "class": type(self.model).__name__,
            "protocol": "text-only (no images), greedy",
            "max_new_tokens": self.max_new_tokens,
            "chat_template": self.has_chat_template,
        }

    def _encode(self, prompt: str):
        if self.has_chat_template:
            enc = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
                return_tensors="pt",
            )
        else:  # no template: the raw prompt (recorded in info()["chat_template"])
            enc = self.tokenizer(prompt, return_tensors="pt")
        return {k: v.to(self.model.device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}

    def __call__(self, prompt: str) -> str:
        enc = self._encode(prompt)
        n_in = enc["input_ids"].shape[1]
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id
        with torch.inference_mode():
            out = self.model.generate(
                **enc, max_new_tokens=self.max_new_tokens, do_sample=False, pad_token_id=pad
            )
        return self.tokenizer.decode(out[0, n_in:], skip_special_tokens=True)

    def judge(self, question: str, reference: str, answer: str) -> str:
        return self(build_judge_prompt(question, reference, answer))


def judge_name(judge: Any) -> dict[str, Any]:
    """What ran as judge: LocalJudge.info(), or a description of any other callable."""
    if judge is None:
        return {"name": None}
    info = getattr(judge, "info", None)
    if callable(info):
        return dict(info())
    return {"name": getattr(judge, "__name__", type(judge).__name__), "path": None}


def mean(values: Iterable[float]) -> float | None:
    vals = [float(v) for v in values]
    return sum(vals) / len(vals) if vals else None
