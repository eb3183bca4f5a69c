"""The lmms-eval wrapper against the real lmms-eval (``pip install 'vlm-kv[lmms]'``; CI installs it).

End to end: lmms-eval's own entry point (``python -m lmms_eval --model vlm_kv ...``) on a tiny
random Qwen2.5-VL saved to a folder and the local MathVision task over the shared testmini data.
Then the wrapper's generate_until and multi-round paths with lmms-eval's own request objects.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

pytest.importorskip("lmms_eval", reason="lmms-eval is not installed (pip install 'vlm-kv[lmms]')")

from lmms_eval.api.instance import Instance  # noqa: E402

from vlm_kv.eval import lmms_eval_model as lem  # noqa: E402
from vlm_kv.eval.lmms_tasks import TASK_NAME, write_mathvision_task  # noqa: E402
from vlm_kv.testing import save_tiny_vlm  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MATHVISION = REPO.parent / "shared" / "data" / "mathvision"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_vlm("qwen2_5_vl", tmp_path_factory.mktemp("tiny_qwen25vl"))


def _offline_env() -> dict:
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false")
    return env


@pytest.mark.skipif(not (MATHVISION / "testmini.jsonl").is_file(), reason="shared MathVision data not found")
def test_lmms_eval_entry_point_runs_our_model_on_the_local_mathvision_task(tmp_path, tiny_folder):
    tasks = write_mathvision_task(tmp_path / "tasks", MATHVISION, max_new_tokens=4)
    cmd = [sys.executable, "-m", "lmms_eval", "--model", "vlm_kv",
           "--model_args", f"pretrained={tiny_folder},policy=snapkv,budget=0.5,device=cpu",
           "--tasks", TASK_NAME, "--include_path", str(tasks), "--limit", "3", "--batch_size", "1",
           "--log_samples", "--output_path", str(tmp_path / "logs")]
    run = subprocess.run(cmd, cwd=tmp_path, env=_offline_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (results_file,) = (tmp_path / "logs").rglob("*_results.json")
    results = json.loads(results_file.read_text())
    assert results["config"]["model_backend"].startswith("vlm_kv.eval.lmms_eval_model.VLMKVLmms")
    assert results["n-samples"][TASK_NAME] == {"original": 304, "effective": 3}
    accuracy = results["results"][TASK_NAME]["accuracy,none"]
    assert 0.0 <= accuracy <= 1.0
    (samples_file,) = (tmp_path / "logs").rglob(f"*{TASK_NAME}*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines() if line.strip()]
    assert len(samples) == 3
    for s in samples:
        assert isinstance(s["filtered_resps"], str)
        assert s["input"].startswith("Please solve the problem step by step")  # the authors' prompt
        assert s["accuracy"] in (0.0, 1.0)


def _failures(output: str) -> list[str]:
    """Lines that say a run failed: lmms-eval logs an error and still exits 0."""
    return [line for line in output.splitlines() if "Traceback" in line or "ERROR" in line or "Error:" in line]


@pytest.mark.skipif(not (MATHVISION / "testmini.jsonl").is_file(), reason="shared MathVision data not found")
def test_readme_lmms_eval_commands_run_from_the_repository_root(tmp_path, tiny_folder):
    # the README's two commands, run where its ../shared paths say you stand: `python -m` puts the
    # working directory on sys.path, so the checkout's top-level folders are importable there
    tasks = tmp_path / "lmms_tasks"
    write = subprocess.run([sys.executable, "-m", "vlm_kv.eval.lmms_tasks", "--data", "../shared/data/mathvision",
                            "--out", str(tasks), "--max-new-tokens", "4"],
                           cwd=REPO, env=_offline_env(), capture_output=True, text=True, timeout=300)
    assert write.returncode == 0 and not _failures(write.stdout + write.stderr), write.stderr[-3000:]
    run = subprocess.run([sys.executable, "-m", "lmms_eval", "--model", "vlm_kv",
                          "--model_args", f"pretrained={tiny_folder},policy=snapkv,budget=0.25",
                          "--tasks", TASK_NAME, "--include_path", str(tasks), "--batch_size", "1",
                          "--output_path", str(tmp_path / "logs"), "--limit", "1"],
                         cwd=REPO, env=_offline_env(), capture_output=True, text=True, timeout=600)
    output = run.stdout + run.stderr
    assert run.returncode == 0 and not _failures(output), output[-4000:]
    (results_file,) = (tmp_path / "logs").rglob("*_results.json")
    assert json.loads(results_file.read_text())["n-samples"][TASK_NAME]["effective"] == 1


@pytest.fixture(scope="module")
def lm(tiny_folder):
    return lem.lmms_class()(pretrained=str(tiny_folder), policy="snapkv", budget=48, max_new_tokens=3,
                            device="cpu", batch_size=1)


def _request(kind, args, doc_id):
    return Instance(request_type=kind, arguments=args, idx=0,
                    metadata={"task": "demo", "doc_id": doc_id, "repeats": 1})


def test_generate_until_with_lmms_eval_instances(lm):
    docs = [{"image": Image.new("RGB", (40, 32), (200, 10, 10))}, {"image": Image.new("RGB", (32, 48), (0, 0, 250))}]
    lm.task_dict = {"demo": {"test": docs}}
    visual = lambda doc: [doc["image"]]  # noqa: E731
    reqs = [_request("generate_until", ("<image>\nWhat colour is this?", {"max_new_tokens": 3, "until": ["\n\n"]},
                                        visual, i, "demo", "test"), i) for i in range(2)]
    out = lm.generate_until(reqs)
    assert len(out) == 2 and all(isinstance(t, str) for t in out)
    assert lm.generator.last_kv_bytes and lm.generator.last_kv_bytes > 0


def test_multi_round_rounds_share_one_compressed_cache(lm):
    docs = [{"images": [Image.new("RGB", (40, 40), (20, 120, 20)), Image.new("RGB", (32, 32), (9, 9, 9))]}]
    lm.task_dict = {"demo": {"test": docs}}
    calls = []

    def doc_to_text(doc, previous_output=None, round_idx=None, previous_round_info=None):
        calls.append((round_idx, list(previous_output), previous_round_info))
        if round_idx == 2:
            return None, None, True, previous_output, previous_round_info
        # round 1: a second image and a follow-up question on top of round 0's cache
        return [doc["images"][1]], "And this one?", False, previous_output, {"round": round_idx}

    req = _request("generate_until_multi_round",
                   ("Describe the first picture.", {"max_new_tokens": 3}, lambda doc: [doc["images"][0]],
                    doc_to_text, 0, "demo", "test"), 0)
    (answers,) = lm.generate_until_multi_round([req])
    assert len(answers) == 2 and all(isinstance(a, str) for a in answers)
    # lmms-eval's protocol: round r sees the answers of rounds < r and the info it returned before
    assert [c[0] for c in calls] == [1, 2]
    assert calls[0][1] == [answers[0]] and calls[0][2] is None
    assert calls[1][1] == list(answers) and calls[1][2] == {"round": 1}


def test_max_pixels_model_argument_sizes_qwen_images(lm, tiny_folder, monkeypatch):
    monkeypatch.setitem(sys.modules, "qwen_vl_utils", None)  # the torchvision-free sizing path
    big = lem.lmms_class()(pretrained=str(tiny_folder), policy="snapkv", budget=48, max_pixels="4096", device="cpu")
    image = Image.new("RGB", (500, 300))
    assert lm.generator._inputs("What?", [image])["image_grid_thw"].tolist() == [[1, 6, 10]]  # processor limit
    assert big.generator._inputs("What?", [image])["image_grid_thw"].tolist() == [[1, 12, 20]]
