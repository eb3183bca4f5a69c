"""Sharded evaluation over 2 CPU processes merges into what a single process writes."""

import json
import os

import pytest
from PIL import Image

import vlm_kv.cli.main as cli
from vlm_kv.eval import mathvision_run as mr
from vlm_kv.eval import mmdu_run as mm
from vlm_kv.eval.shard import Shard
from vlm_kv.testing import save_tiny_vlm

TIMING = ("seconds",)  # wall-clock, differs between any two runs


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return str(save_tiny_vlm("qwen2_5_vl", tmp_path_factory.mktemp("tiny_qwen25vl")))


@pytest.fixture(autouse=True)
def one_thread_children(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _rows(path):
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def test_shard_picks_interleaved_slices():
    items = list(range(7))
    parts = [Shard(r, 3).pick(items) for r in range(3)]
    assert parts == [[0, 3, 6], [1, 4], [2, 5]]
    assert sorted(sum(parts, [])) == items


def test_mathvision_two_processes_merge_to_the_single_process_files(tiny_folder, shared_data, tmp_path):
    common = ["eval", "mathvision", "--model", tiny_folder, "--data", str(shared_data / "mathvision"),
              "--limit", "3", "--policy", "streaming_llm", "--budget", "48", "--max-new-tokens", "3",
              "--device", "cpu", "--no-progress"]
    assert cli.main(common + ["--out", str(tmp_path / "one")]) == 0
    assert cli.main(common + ["--out", str(tmp_path / "two"), "--num-processes", "2"]) == 0
    one, two = tmp_path / "one", tmp_path / "two"
    assert sorted(p.name for p in (two / "shards").iterdir()) == ["rank-0-of-2", "rank-1-of-2"]
    single, merged = _rows(one / mr.RESPONSES_FILE), _rows(two / mr.RESPONSES_FILE)
    assert len(single) == 3 and merged == single
    assert (two / mr.RESULT_FILE).read_text() == (one / mr.RESULT_FILE).read_text()
    summary_one = json.loads((one / mr.SUMMARY_FILE).read_text())
    summary_two = json.loads((two / mr.SUMMARY_FILE).read_text())
    assert summary_two == summary_one


def test_mmdu_two_processes_merge_to_the_single_process_answers(tiny_folder, tmp_path):
    (tmp_path / "pics").mkdir()
    bench = {}
    for d in range(3):
        Image.new("RGB", (24, 20), (60 * d, 120, 200)).save(tmp_path / "pics" / f"{d}.png")
        bench[str(d)] = {"id": d, "image": [f"pics/{d}.png"], "conversations": [
            {"from": "user", "value": "<ImageHere>What colour is this picture?"},
            {"from": "assistant", "value": "Blue."},
            {"from": "user", "value": "Is it dark?"},
            {"from": "assistant", "value": "No."}]}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    common = ["eval", "mmdu", "--model", tiny_folder, "--data", str(tmp_path / "bench.json"), "--images",
              str(tmp_path), "--no-judge", "--policy", "streaming_llm", "--budget", "48", "--max-new-tokens", "3",
              "--device", "cpu"]
    assert cli.main(common + ["--out", str(tmp_path / "one")]) == 0
    assert cli.main(common + ["--out", str(tmp_path / "two"), "--num-processes", "2"]) == 0
    single = _rows(tmp_path / "one" / mm.ANSWERS_FILE)
    merged = _rows(tmp_path / "two" / mm.ANSWERS_FILE)
    assert len(single) == 6 and merged == single
    s1 = json.loads((tmp_path / "one" / mm.SUMMARY_FILE).read_text())
    s2 = json.loads((tmp_path / "two" / mm.SUMMARY_FILE).read_text())
    for key in ("rouge_l", "n_questions", "n_answered", "kv_bytes", "policy", "budget"):
        assert s2.get(key) == s1.get(key), key
    assert os.path.isdir(tmp_path / "two" / "shards" / "rank-1-of-2")
