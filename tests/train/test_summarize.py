import json

import pytest

from vlm_kv.train.summarize import fidelity_columns, main, training_summary


def _write_run(folder, caps, secs):
    folder.mkdir()
    with open(folder / "metrics.jsonl", "w") as fh:
        for i, (c, s) in enumerate(zip(caps, secs)):
            fh.write(json.dumps({"step": i + 1, "cap": c, "sec": s, "live": 0.5 - 0.01 * i, "kl": 0.1}) + "\n")


def test_training_summary_counts_binding_steps_and_time(tmp_path):
    _write_run(tmp_path / "r", caps=[0.3, 0.0, 0.1, 0.0, 0.2], secs=[1.0, 2.0, 3.0, 4.0, 5.0])
    s = training_summary(str(tmp_path / "r"))
    assert s["steps_logged"] == 5 and s["cap_nonzero_steps"] == 3
    assert s["train_seconds"] == 15.0 and s["sec_per_step"] == 3.0
    assert s["cap_mean"] == pytest.approx(0.12) and s["live_end"] == pytest.approx(0.48)
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        training_summary(str(tmp_path))


def test_fidelity_columns_split_sinks_from_nosinks_and_ignore_other_labels(tmp_path):
    rows = [
        {"label": "a", "budget": 0.1, "kl": 0.07123, "top1": 0.8125, "scorer_kwargs": {}},
        {"label": "a-nosinks", "budget": 0.1, "kl": 0.3, "top1": 0.6, "scorer_kwargs": {"num_sinks": 0}},
        {"label": "ab", "budget": 0.1, "kl": 9.0, "top1": 0.0, "scorer_kwargs": {}},
        {"label": "a", "budget": 0.05, "kl": 0.14, "top1": 0.78, "scorer_kwargs": {}},
    ]
    cols = fidelity_columns(rows, "a")
    assert cols == {"kl@0.1": 0.0712, "top1@0.1": 0.812, "kl_nosinks@0.1": 0.3, "top1_nosinks@0.1": 0.6,
                    "kl@0.05": 0.14, "top1@0.05": 0.78}
    _write_run(tmp_path / "r", caps=[0.1], secs=[2.0])
    fid = tmp_path / "f.jsonl"
    fid.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "t.jsonl"
    assert main(["--run", f"a={tmp_path / 'r'}", "--fidelity", str(fid), "--out", str(out),
                 "--csv", str(tmp_path / "t.csv")]) == 0
    line = json.loads(out.read_text())
    assert line["label"] == "a" and line["kl@0.1"] == 0.0712 and line["cap_nonzero_steps"] == 1
    assert (tmp_path / "t.csv").read_text().startswith("label,run,")
