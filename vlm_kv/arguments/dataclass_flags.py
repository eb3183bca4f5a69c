"""Command-line flags generated from a config dataclass, so a setting is declared once.

    @dataclass
    class RunConfig:
        steps: int = setting(100, "optimizer steps")
        progress: bool = setting(True, "show a progress bar")

    add_dataclass_args(parser, RunConfig)          # --steps N, --progress / --no-progress
    cfg = dataclass_from_args(RunConfig, args)     # then cfg.validate(), if it has one

Each field becomes ``--field-name`` with the field's type, default and help; booleans get a
``--name`` / ``--no-name`` pair. Only ``int``, ``float``, ``str`` and ``bool`` fields are
supported: anything else raises when the parser is built, not when a user runs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

__all__ = ["setting", "add_dataclass_args", "dataclass_from_args"]

_SCALARS = (int, float, str)


def setting(default: Any, help: str) -> Any:  # noqa: A002 - argparse's own word
    """A dataclass field with its default and the help its generated flag shows."""
    return dataclasses.field(default=default, metadata={"help": help})


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, exclude: tuple[str, ...] = ()) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        kind = hints[f.name]
        help_text = f.metadata.get("help", "")
        default = f.default
        if kind is bool:
            parser.add_argument(_flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                                default=default, help=f"{help_text} (default: {default})")
        elif kind in _SCALARS:
            parser.add_argument(_flag(f.name), dest=f.name, type=kind, default=default,
                                help=f"{help_text} (default: {default})")
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: type {kind!r} has no generated flag")


def dataclass_from_args(cls: type, args: argparse.Namespace, **overrides: Any):
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values.update(overrides)
    return cls(**values)
