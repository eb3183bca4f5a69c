"""scripts/layer_profile_strategy.py (a strategy from another policy's kept sets) and the variant labels of
scripts/retrieval_table.py (a run with other cache settings never pools into the default's cell)."""
import importlib.util
import json
from pathlib import Path

import pytest

from vlm_kv.policies.strategy import Strategy

REPO = Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def base() -> Strategy:
    return Strategy.load(str(REPO / "docs" / "polykv" / "smollm2_pg1342_b0.1.json"))


def _kept(counts_by_trial: list[list[int]], budget: str = "0.05") -> dict:
    return {"rows": [{"budgets": {budget: {"entries_per_layer": c}}} for c in counts_by_trial]}


def test_layer_shares_average_each_trials_split(base):
    mod = _script("layer_profile_strategy")
    n = base.num_layers
    a = [10] * n
    b = [10] * n
    b[3] = 10 + 9 * n  # trial b holds 10x as much in layer 3
    shares = mod.layer_shares(_kept([a, b]), "0.05")
    assert sum(shares) == pytest.approx(1.0)
    assert shares[3] == pytest.approx((1 / n + (10 + 9 * n) / (10 * n + 9 * n)) / 2)
    assert shares[0] == pytest.approx((1 / n + 10 / (19 * n)) / 2)
    with pytest.raises(SystemExit, match="no trial"):
        mod.layer_shares(_kept([a]), "0.1")


def test_the_strategy_gives_each_layer_its_share_under_the_cap(base, tmp_path):
    mod = _script("layer_profile_strategy")
    n = base.num_layers
    shares = [0.5] + [0.5 / (n - 1)] * (n - 1)  # layer 0 would need 15x its whole cache at 0.1
    strategy = mod.profile_strategy(base, shares, "dbtrimkv", "test")
    for phase in strategy.layers:
        budgets = [e.budget for e in strategy.phase(phase)]
        assert sum(budgets) == pytest.approx(base.budget)
        assert {e.pattern for e in strategy.phase(phase)} == {"dbtrimkv"}
        assert budgets[0] >= budgets[1] * 2  # still the largest after the cap and rescale
        assert budgets[1] == pytest.approx(budgets[2])
    path = tmp_path / "s.json"
    strategy.save(str(path))
    assert Strategy.load(str(path)).phase("decode")[0].budget == pytest.approx(strategy.phase("decode")[0].budget)
    with pytest.raises(SystemExit, match="layers"):
        mod.profile_strategy(base, shares[:-1], "dbtrimkv", "test")


def _sweep(folder: Path, cache_kwargs: dict, hits: int) -> None:
    records = [{"correct": i < hits, "full_correct": True} for i in range(4)]
    row = {"policy": "dbtrimkv", "budget": 0.05, "accuracy": hits / 4, "full_accuracy": 1.0, "records": records,
           "max_kv_bytes_after_eviction": 5, "full_kv_bytes_at_end": 100, "error": None}
    folder.mkdir(parents=True)
    (folder / "sweep_retrieval.json").write_text(json.dumps(
        {"settings": {"model": "smollm2", "ask": "later", "cache_kwargs": cache_kwargs}, "rows": [row]}))


def test_a_variant_run_keeps_a_cell_of_its_own_when_pooled(tmp_path):
    table = _script("retrieval_table")
    gates = {"gates": "docs/retrieval/gates/facts-aw05"}
    _sweep(tmp_path / "a" / "default", gates, 2)
    _sweep(tmp_path / "a" / "span", {**gates, "options": {"scorer_kwargs": {"span": 5}}}, 1)
    _sweep(tmp_path / "a" / "layers", {**gates, "strategy": "x/kvzip_layers.json"}, 3)
    _sweep(tmp_path / "b" / "default", gates, 4)
    cells = {c["cache"]: (c["hits"], c["n"]) for c in table.pooled([tmp_path / "a", tmp_path / "b"])}
    assert cells == {"dbtrimkv [facts-aw05] (fp32)": (6, 8),
                     "dbtrimkv [facts-aw05] {span=5} (fp32)": (1, 4),
                     "dbtrimkv [facts-aw05] <kvzip_layers> (fp32)": (3, 4)}
