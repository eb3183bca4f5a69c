import argparse
from dataclasses import dataclass

import pytest

from vlm_kv.arguments.dataclass_flags import add_dataclass_args, dataclass_from_args, setting


@dataclass
class _Cfg:
    steps: int = setting(3, "steps")
    rate: float = setting(0.5, "rate")
    name: str = setting("x", "name")
    progress: bool = setting(True, "bar")


def test_flags_follow_the_fields():
    p = argparse.ArgumentParser()
    add_dataclass_args(p, _Cfg)
    cfg = dataclass_from_args(_Cfg, p.parse_args(["--steps", "7", "--no-progress", "--rate", "0.25"]))
    assert cfg == _Cfg(steps=7, rate=0.25, name="x", progress=False)
    assert dataclass_from_args(_Cfg, p.parse_args([])) == _Cfg()
    with pytest.raises(SystemExit):
        p.parse_args(["--steps", "many"])


def test_unsupported_field_type_fails_when_the_parser_is_built():
    @dataclass
    class Bad:
        items: list = setting(None, "x")

    with pytest.raises(TypeError, match="no generated flag"):
        add_dataclass_args(argparse.ArgumentParser(), Bad)


def test_train_vlm_checks_its_settings_before_loading(capsys):
    from vlm_kv.cli.main import main

    assert main(["train-vlm", "--multi-images", "6,2", "--out", "/nonexistent/never"]) == 2
    assert "multi_images" in capsys.readouterr().err
