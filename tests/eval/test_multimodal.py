"""The multimodal benchmark's rows, on a tiny language model with SmolLM2's tokenizer (code paths;
quality is measured on smollava)."""

import pytest

from vlm_kv.eval.multimodal import ROW_FIELDS, MultimodalBench, MultimodalSettings


@pytest.fixture(scope="module")
def tiny(tiny_smollava):
    return tiny_smollava


def _bench(tiny, **kw):
    model, processor = tiny
    settings = MultimodalSettings(data_seed=3, items=1, tasks=("single", "multi_turn"), max_new_tokens=2, **kw)
    return MultimodalBench(model, processor, settings)


def test_full_row_is_its_own_reference(tiny):
    (single, turns) = _bench(tiny).run("full", 1.0)
    for row in (single, turns):
        assert set(ROW_FIELDS) <= set(row)
        assert row["accuracy"] == row["full_accuracy"] and row["relative_accuracy"] == 1.0 and row["kl"] == 0.0
        assert row["kv_bytes"] == row["full_kv_bytes"] > 0
    assert len(turns["turn_accuracy"]) >= 4


def test_compressed_rows_hold_fewer_bytes_and_report_visual_share(tiny):
    bench = _bench(tiny)
    rows = bench.run("snapkv", 0.1)
    for row in rows:
        assert row["error"] is None
        assert 0 < row["kv_bytes"] < row["full_kv_bytes"]
        assert row["max_kv_bytes"] <= 0.1 * row["full_kv_bytes"] * 1.2
        assert row["kl"] >= 0.0
        assert 0.0 <= row["visual_share"] <= 1.0
        assert len(row["visual_share_per_layer"]) == 2
    # budget >= sequence: the same answers and (numerically) no KL
    (same, _) = bench.run("snapkv", 1.0)
    assert same["accuracy"] == same["full_accuracy"]
    assert same["kl"] < 1e-4


def test_rows_record_each_question_so_a_miss_can_be_traced(tiny):
    bench = _bench(tiny)
    for full, row in zip(bench.run("full", 1.0), bench.run("snapkv", 0.1)):
        items = bench.items(row["task"])
        expected = [(it.index, k + 1, q.image_index, q.kind, q.answer) for it in items for k, q in enumerate(it.questions)]
        for r in (full, row):
            assert [(x["item"], x["turn"], x["image"], x["kind"], x["answer"]) for x in r["questions"]] == expected
            assert sum(x["correct"] for x in r["questions"]) / len(expected) == pytest.approx(r["accuracy"])
            assert sum(x["full_correct"] for x in r["questions"]) / len(expected) == pytest.approx(r["full_accuracy"])
        assert all(isinstance(x["given"], str) for x in row["questions"])
        assert "given" not in full["questions"][0]


def test_a_policy_that_cannot_run_is_a_row_with_its_error(tiny):
    (row, _) = _bench(tiny).run("dbtrimkv", 0.1)  # no gates exist for the tiny model
    assert row["error"] and "gates" in row["error"]
    assert row.get("accuracy") is None


def test_settings_are_checked():
    with pytest.raises(ValueError, match="tasks"):
        MultimodalSettings(tasks=("video",)).validate()
    with pytest.raises(ValueError, match="noise"):
        MultimodalSettings(images="blank").validate()


def test_the_full_pass_is_saved_and_reused_only_for_the_same_items_and_weights(tiny, tmp_path, monkeypatch):
    import torch

    model, processor = tiny
    settings = MultimodalSettings(data_seed=3, items=1, tasks=("multi_turn",), max_new_tokens=2)
    first = MultimodalBench(model, processor, settings, reference_dir=tmp_path)
    row = first.run_task("snapkv", 0.25, "multi_turn")
    assert (tmp_path / "full_reference_multi_turn.pt").is_file()
    # only the answer tokens' rows are kept (not every position's log-probs)
    logps = [t for _, item_logps, _ in first._full("multi_turn") for t in item_logps]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in logps}
    assert sum(storages.values()) == sum(t.numel() * t.element_size() for t in logps)
    # a second process with the same items and weights: no full pass, the same row
    again = MultimodalBench(model, processor, settings, reference_dir=tmp_path)
    monkeypatch.setattr(again, "_forced_logprobs", _forced_once(again._forced_logprobs))
    same = again.run_task("snapkv", 0.25, "multi_turn")
    assert {k: v for k, v in same.items() if k != "seconds"} == {k: v for k, v in row.items() if k != "seconds"}
    # other items, or other weights: computed again (and saved over)
    other = MultimodalBench(model, processor, MultimodalSettings(data_seed=4, items=1, tasks=("multi_turn",),
                                                                 max_new_tokens=2), reference_dir=tmp_path)
    assert other._load_reference("multi_turn") is None
    with torch.no_grad():
        param = next(model.parameters())
        kept = param.clone()
        param.add_(1.0)
        try:
            assert MultimodalBench(model, processor, settings, reference_dir=tmp_path)._load_reference("multi_turn") is None
        finally:
            param.copy_(kept)
    assert MultimodalBench(model, processor, settings, reference_dir=tmp_path)._load_reference("multi_turn") is not None


def _forced_once(forced):
    """The compressed cache's forced pass only: a DynamicCache (the full pass) must not be fed."""
    from transformers import DynamicCache

    def run(item, cache):
        assert type(cache) is not DynamicCache, "the full cache's pass ran again"
        return forced(item, cache)
    return run
