"""The main CLI keeps a sub-command visible when its module fails to import."""

import sys

import pytest

import vlm_kv.cli.main as cli


@pytest.mark.parametrize("module, command", [
    ("vlm_kv.eval.cli", "eval"),("vlm_kv.eval.sweep_cli", "sweep"), ("vlm_kv.train.cli", "train-gates")])
def test_failed_import_shows_the_command_with_its_error(monkeypatch, capsys, module, command):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    parser = cli.build_parser()
    assert command in parser.format_help()
    assert "unavailable" in parser.format_help()
    rc = cli.main([command, "--anything", "x"])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"vlm-kv {command}: unavailable" in err and module in err


def test_failed_mmdu_import_is_shown_under_eval(monkeypatch, capsys):
    import vlm_kv.eval

    monkeypatch.setitem(sys.modules, "vlm_kv.eval.mmdu_cli", None)
    monkeypatch.delattr(vlm_kv.eval, "mmdu_cli", raising=False)  # `from vlm_kv.eval import` reads it first
    assert cli.main(["eval", "mmdu", "--model", "m"]) == 2
    assert "vlm-kv mmdu: unavailable, importing vlm_kv.eval.mmdu_cli failed" in capsys.readouterr().err


def test_commands_register_when_imports_work():
    help_text = cli.build_parser().format_help()
    for command in ("eval", "sweep", "train-gates"):
        assert command in help_text
    assert "unavailable" not in help_text
