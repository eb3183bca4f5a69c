"""Checks of command-line inputs that run before any model loads."""

from __future__ import annotations

import os


def check_text_file(path: str | None) -> None:
    """A text file argument exists and is not empty (None: not given)."""
    if path is None:
        return
    if not os.path.isfile(path):
        raise FileNotFoundError(f"text file not found: {path}")
    if os.path.getsize(path) == 0:
        raise ValueError(f"text file {path} is empty")
