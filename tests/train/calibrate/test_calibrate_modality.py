"""Modality shares calibrated on image data (MathVision-style JSONL + images) with a tiny
random-weight Qwen2.5-VL: code paths only. Shares sum to 1 per layer over the modalities
present, the calibration is deterministic and resumes to the same strategy, the strategy runs
within the budget, and bad data or options fail with a clear error."""
import json

import pytest
import torch
from PIL import Image

import vlm_kv
from vlm_kv.train.calibrate import modality as calibrate_modality
from vlm_kv.train.calibrate.calibrate import CalibrationConfig, Calibrator, calibrate, plot_strategy
from vlm_kv.train.calibrate.modality import less_shares, modality_shares, start_shares
from vlm_kv.policies.strategy import Strategy
from vlm_kv.testing import (
    record_evictions,
    tiny_inputs,
    tiny_model,
    tiny_processor,
    tiny_tokenizer,
)

QUESTIONS = ["How many dots?\n<image1>", "Which colour is on top?\n<image1>", "What is the sum?\n<image1>"]


def _write_data(folder, rows, name="problems.jsonl"):
    path = folder / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _row(i, image):
    return {"id": str(i), "question": QUESTIONS[i % 3], "options": [], "answer": "1", "solution": None,
            "level": 1, "subject": "counting", "image": image}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's ops are too small to split: on a busy 2-core machine two threads made the
    calibration 20x slower than one (30 s vs 1.3 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mv")
    (folder / "images").mkdir()
    gen = torch.Generator().manual_seed(0)
    for i, (w, h) in enumerate([(64, 64), (80, 48), (48, 72)]):
        pixels = torch.randint(0, 256, (h, w, 3), generator=gen, dtype=torch.uint8).numpy()
        Image.fromarray(pixels).save(folder / "images" / f"{i}.png")
    data = _write_data(folder, [_row(i, f"images/{i}.png") for i in range(3)])
    return tiny_model("qwen2_5_vl", num_layers=2), tiny_processor("qwen2_5_vl"), data, folder


def _config(**kw):
    # 64x64 pixels: 64 image tokens a problem beside ~110 text tokens (lmms-eval's short prompt)
    base = dict(budget=0.3, candidates=["tova", "h2o"], continuation=4, evict_every=2, windows_per_file=2, seed=1,
                max_pixels=64 * 64, prompt_style="lmms-eval")
    base.update(kw)
    return CalibrationConfig(**base)


def _strip(strategy):
    d = strategy.to_dict()
    d["calibration"].pop("measure_seconds")
    return d


def test_share_rules():
    assert start_shares({"text": 30.0, "image": 10.0, "video": 0.0}, ["text", "image"]) == {"text": 0.75, "image": 0.25}
    assert start_shares({"text": 0.0, "image": 0.0}, ["text", "image"]) == {"text": 0.5, "image": 0.5}
    less = less_shares({"text": 0.6, "image": 0.3, "video": 0.1}, "image", 0.5)
    assert less == pytest.approx({"text": 0.6 + 0.15 * 6 / 7, "image": 0.15, "video": 0.1 + 0.15 / 7})
    assert less_shares({"text": 0.0, "image": 1.0}, "image", 0.25) == pytest.approx({"text": 0.75, "image": 0.25})
    start = {"text": 0.7, "image": 0.3}
    # equal sensitivities (or none) keep the start split, up to the floor
    assert modality_shares(start, {"text": 2.0, "image": 2.0}, 0.0) == pytest.approx(start)
    assert modality_shares(start, {"text": 0.0, "image": 0.0}, 0.0) == pytest.approx(start)
    # a more sensitive modality gains; an insensitive one falls to the floor, never to 0
    moved = modality_shares(start, {"text": 1.0, "image": 3.0}, 0.05)
    assert moved["image"] > 0.3 and sum(moved.values()) == pytest.approx(1.0)
    assert modality_shares(start, {"text": 0.0, "image": 1.0}, 0.05) == pytest.approx({"text": 0.05, "image": 0.95})
    with pytest.raises(ValueError, match="floor"):
        modality_shares(start, {}, 0.5)


def test_image_calibration_writes_shares_is_deterministic_and_resumes(setup, monkeypatch):
    model, processor, data, folder = setup
    images = str(folder)
    progress = folder / "a.progress.json"
    full = calibrate(model, processor, [data], _config(), progress_path=str(progress), show_progress=False,
                     images=images)
    for entry in full.layers["prefill"]:
        assert set(entry.modality) == {"text", "image"}
        assert sum(entry.modality.values()) == pytest.approx(1.0)
        assert min(entry.modality.values()) >= 0.05 - 1e-9
        sig = entry.signals["modality"]
        assert set(sig["sensitivity"]) == {"text", "image"} and sig["start"]["image"] > 0
        assert entry.modality == pytest.approx(modality_shares(sig["start"], sig["sensitivity"], 0.05))
    cal = full.calibration
    assert cal["images"]["windows"] == 2 and cal["images"]["images"] == 2 and cal["modalities"] == ["text", "image"]
    assert all(w["image_tokens"] > 0 and w["tokens"] == w["prompt_tokens"] + 5 for w in cal["data"])
    saved = json.loads(progress.read_text())
    results = saved["results"]
    # the probe that takes half the image share keeps fewer images in that layer than the start
    for layer, entry in enumerate(full.layers["prefill"]):
        head = f"modality|{layer}|{entry.pattern}|{entry.budget * 2:.6g}"
        assert results[f"{head}|less:imagex0.5"]["kept"]["image"] < results[f"{head}|start"]["kept"]["image"]
    # same seed, no progress file: the same strategy
    again = calibrate(model, processor, [data], _config(), show_progress=False, images=images)
    assert _strip(again) == _strip(full)
    # interrupted: drop the modality probes of layer 1 and one pattern probe, resume, same strategy
    keep = {k: v for k, v in results.items() if not k.startswith("modality|1|") and k != "1|prefill|h2o|1"}
    dropped = len(results) - len(keep)
    partial = folder / "b.progress.json"
    partial.write_text(json.dumps(dict(saved, results=keep)))
    calls = []
    original = calibrate_modality.measure_modality_probe
    monkeypatch.setattr(calibrate_modality, "measure_modality_probe", lambda *a: calls.append(a) or original(*a))
    cal = Calibrator(model, processor, [data], _config(), progress_path=str(partial), show_progress=False,
                     images=images)
    measured = []
    original_measure = cal.measure
    cal.measure = lambda *a: measured.append(a) or original_measure(*a)
    resumed = cal.run()
    assert len(calls) + len(measured) == dropped and len(measured) == 1
    assert _strip(resumed) == _strip(full)
    # the strategy saves, loads for this model and runs within the budget on other inputs
    path = folder / "s.json"
    full.save(str(path))
    loaded = Strategy.load(str(path), model=model)
    assert [e.modality for e in loaded.layers["prefill"]] == [e.modality for e in full.layers["prefill"]]
    cache = vlm_kv.make_cache(model, policy="polykv", budget=0.3, strategy=str(path),
                              options=vlm_kv.CacheOptions(evict_every=4))
    steps = record_evictions(cache)
    inputs = tiny_inputs(model, num_images=2, text_len=60)
    with torch.no_grad():
        model(**inputs, past_key_values=cache, use_cache=True)
        for _ in range(8):
            model(input_ids=torch.tensor([[40]]), past_key_values=cache, use_cache=True)
    assert len(steps) == 3 and all(held <= allowed for held, allowed in steps)  # after every eviction step
    assert cache.stats()["per_modality"]["image"] > 0
    # the plot draws the modality shares of the phase
    drawn = []
    import vlm_kv.train.calibrate.calibrate as calibrate_module
    monkeypatch.setattr(calibrate_module, "_plot_modality_shares", lambda ax, entries, phase: drawn.append(phase))
    plot_strategy(full, str(folder / "s.png"))
    assert drawn == ["prefill"] and (folder / "s.png").stat().st_size > 1000


def test_bad_image_data_and_models_fail_clearly(setup, tmp_path):
    model, processor, data, folder = setup
    (tmp_path / "images").mkdir()
    missing = _write_data(tmp_path, [_row(0, "images/none.png")])
    with pytest.raises(ValueError, match=r"image not found: .*none\.png"):
        Calibrator(model, processor, [missing], _config(windows_per_file=1), show_progress=False, images=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="images folder not found"):
        Calibrator(model, processor, [data], _config(), show_progress=False, images=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="holds only 3 problems"):
        Calibrator(model, processor, [data], _config(windows_per_file=4), show_progress=False, images=str(folder))
    with pytest.raises(ValueError, match="needs the model's processor"):
        Calibrator(model, processor.tokenizer, [data], _config(), show_progress=False, images=str(folder))
    with pytest.raises(ValueError, match="needs a vision-language model"):
        Calibrator(tiny_model("llama"), tiny_tokenizer("llama"), [data], _config(), show_progress=False,
                   images=str(folder))
    text = tmp_path / "t.txt"
    text.write_text("alpha beta " * 200)
    with pytest.raises(ValueError, match="max_pixels apply to image data"):
        Calibrator(tiny_model("llama"), tiny_tokenizer("llama"), [str(text)], _config(), show_progress=False)
    with pytest.raises(ValueError, match="modality_factor"):
        _config(modality_factor=1.0).check()


def test_cli_image_data(setup, tmp_path, capsys):
    from vlm_kv.cli.main import main
    from vlm_kv.testing import save_tiny_vlm

    _, _, data, folder = setup
    base = ["calibrate", "--budget", "0.3", "--out", str(tmp_path / "s.json")]
    # refused before any model loads
    assert main(base + ["--model", "smollm2", "--data", data, "--images", str(folder)]) == 2
    assert "--images needs a vision-language model" in capsys.readouterr().err
    assert main(base + ["--data", str(tmp_path / "x.txt"), "--max-pixels", "4096"]) == 2
    assert "--max-pixels apply to image data" in capsys.readouterr().err
    assert main(base + ["--data", data]) == 2
    assert "give --images DIR" in capsys.readouterr().err
    vlm = save_tiny_vlm("qwen2_5_vl", tmp_path / "vlm")
    (tmp_path / "images").mkdir()
    missing = _write_data(tmp_path, [_row(0, "images/gone.jpg")])
    assert main(base + ["--model", vlm, "--data", missing, "--images", str(tmp_path)]) == 2
    assert "image not found" in capsys.readouterr().err
    # the whole command on the tiny VLM: strategy with shares, plot, progress file
    assert main(base + ["--model", vlm, "--data", data, "--images", str(folder), "--candidates", "tova",
                        "--windows", "1", "--continuation", "2", "--max-pixels", "4096", "--prompt-style",
                        "lmms-eval"]) == 0
    assert "modality shares: 0:text=" in capsys.readouterr().out
    strategy = Strategy.load(str(tmp_path / "s.json"))
    assert all(sum(e.modality.values()) == pytest.approx(1.0) for e in strategy.layers["prefill"])
    assert (tmp_path / "s.png").is_file() and (tmp_path / "s.progress.json").is_file()
