"""The README's how-tos run as written, and its table rows come from the files they cite."""
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")


def _block_after(marker: str, language: str) -> str:
    """The first fenced ``language`` block after ``marker`` in the README."""
    start = README.index(marker)
    match = re.compile(rf"```{language}\n(.*?)```", re.S).search(README, start)
    assert match is not None, f"no {language} block after {marker!r}"
    return match.group(1)


def test_smollm2_howto_runs(smollm2, monkeypatch, capsys):
    import vlm_kv.models.smollm2

    monkeypatch.setattr(vlm_kv.models.smollm2, "load_smollm2", lambda: smollm2)  # the session's copy, loaded once
    exec(compile(_block_after("**SmolLM2 from Python.**", "python"), "README.md", "exec"), {})
    answer, numbers = capsys.readouterr().out.strip().rsplit("\n", 1)
    kv_total, entries = (int(x) for x in numbers.split())
    assert answer.strip() and kv_total > 0 and entries > 0


def test_tiny_vlm_and_mmdu_howto_run_from_the_repository_root(tmp_path):
    # as written, from the repository root; the runs/ folder moved into the test's own folder
    for line in _block_after("**A tiny VLM for the eval commands", "bash").strip().splitlines():
        argv = shlex.split(line.replace("runs/", f"{tmp_path}/"))
        if argv[0] == "vlm-kv":
            argv = [sys.executable, "-m", "vlm_kv.cli.main", *argv[1:]]
        elif argv[0] == "python":
            argv[0] = sys.executable
        run = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600,
                             env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"))
        assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr[-3000:]
    summary = json.loads((tmp_path / "mmdu-try" / "summary.json").read_text(encoding="utf-8"))
    assert summary["n_dialogs"] == 2 and summary["n_questions"] == 5 and summary["n_answered"] == 5


def _footnote_file(mark: str) -> Path:
    """The jsonl a table footnote (², ³) cites: the first linked .jsonl after the mark below the table."""
    table_end = README.index("| dbtrimkv (v1 gates")
    at = README.index(f"{mark} ", README.index("\n\n", table_end))
    return REPO / re.search(r"\((docs/[^)]+\.jsonl)\)", README[at:]).group(1)


def test_gated_rows_of_the_fidelity_table_are_in_the_files_they_cite():
    rows = re.findall(r"^\| (.*dbtrimkv.*?) ([²³]) \| \**([0-9.]+)\**", README, re.M)
    assert len(rows) >= 3
    for name, mark, kl in rows:
        records = [json.loads(line) for line in _footnote_file(mark).read_text().splitlines() if line.strip()]
        no_sinks = "without sinks" in name
        cited = [r for r in records if r["budget"] == 0.1 and r["policy"] == "dbtrimkv"
                 and ((r.get("scorer_kwargs") or {}).get("num_sinks") == 0) == no_sinks]
        assert any(f"{r['kl']:.4f}" == kl for r in cited), (name, kl, _footnote_file(mark).name)
