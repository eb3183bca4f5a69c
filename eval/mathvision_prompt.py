"""Prompts for MathVision generation.

Two styles, chosen by name:

``"authors"`` (default)
    The benchmark authors' chain-of-thought prompt: the instruction, a line
    break, the question, a line break, then, for multiple-choice problems
    whose options are not just the letters A-E, one ``"(A) text"`` line per
    option.

``"lmms-eval"``
    The variant of lmms-eval's ``mathvision`` task: the shorter instruction
    followed directly by the question; for multiple-choice problems
    ``"\\nChoices: "`` + one ``"A. text"`` line per option (the letters are
    listed even when the options are only "A".."E") + a line asking for the
    option's letter.

The image is the single visual input; the ``<image1>`` placeholder stays in
the question text, as in both references.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

__all__ = [
    "AUTHORS_INSTRUCTION",
    "LMMS_EVAL_INSTRUCTION",
    "LMMS_EVAL_MC_INSTRUCTION",
    "PROMPT_STYLES",
    "build_messages",
    "build_prompt",
]

AUTHORS_INSTRUCTION = (
    'Please solve the problem step by step and put your answer in one "\\boxed{}". '
    'If it is a multiple choice question, only one letter is allowed in the "\\boxed{}".'
)
LMMS_EVAL_INSTRUCTION = 'Please solve the problem step by step and put your answer in one "\\boxed{}".'
LMMS_EVAL_MC_INSTRUCTION = "Answer the question with the option's letter from the given choices directly."

PROMPT_STYLES = ("authors", "lmms-eval")
_LETTERS = "ABCDE"


def _get(problem: Any, name: str, default: Any = None) -> Any:
    if isinstance(problem, Mapping):
        return problem.get(name, default)
    return getattr(problem, name, default)


def _authors_prompt(question: str, options: Sequence[str]) -> str:
    block = ""
    if options and "".join(options) != _LETTERS:
        block = "".join(f"({_LETTERS[i]}) {opt}\n" for i, opt in enumerate(options))
    return f"{AUTHORS_INSTRUCTION}\n{question}\n{block}"


def _lmms_eval_prompt(question: str, options: Sequence[str]) -> str:
    if not options:
        return LMMS_EVAL_INSTRUCTION + question
    choices = "\n".join(f"{chr(ord('A') + i)}. {opt}" for i, opt in enumerate(options))
    return f"{LMMS_EVAL_INSTRUCTION}{question}\nChoices: {choices}\n{LMMS_EVAL_MC_INSTRUCTION}"


def build_prompt(problem: Any, style: str = "authors") -> str:
    """The text prompt for ``problem`` (a MathVisionProblem or a dict)."""
    question = str(_get(problem, "question", "") or "")
    options = list(_get(problem, "options", None) or [])
    if style == "authors":
        return _authors_prompt(question, options)
    if style == "lmms-eval":
        return _lmms_eval_prompt(question, options)
    raise ValueError(f"unknown MathVision prompt style {style!r}; choose one of {', '.join(PROMPT_STYLES)}")


def build_messages(problem: Any, style: str = "authors") -> list[dict[str, Any]]:
    """Chat messages for ``processor.apply_chat_template`` (Qwen2-VL / LLaVA style):
    one user turn holding the image placeholder and then the prompt text."""
    return [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": build_prompt(problem, style)},
            ],
        }
    ]
