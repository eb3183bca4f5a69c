"""One ``vlm-kv bench`` run in its own process: ``python -m vlm_kv.cli.bench_worker '<json spec>'``.

Loads the model, warms it up, runs the one (context, cache) of the spec and prints its row as
JSON on the last line of stdout. ``vlm_kv.cli.bench.bench_isolated`` starts one per run.
"""

from __future__ import annotations

import json
import sys

import torch

from vlm_kv.cli.bench import BenchPlan, bench_tokens, run_planned, warm_up
from vlm_kv.models.named import load_model


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    model, tokenizer = load_model(spec["model"], dtype=getattr(torch, spec["dtype"]))
    model = model.to(spec["device"])
    context = spec["run"][0]
    ids = bench_tokens(tokenizer, spec["plan"]["text_path"], context + 1)
    warm_up(model)
    plan = BenchPlan(**{k: tuple(v) if k in ("contexts", "policies", "budgets") else v
                        for k, v in spec["plan"].items()})
    row = run_planned(model, ids, tuple(spec["run"]), plan, plan.repeats)
    print(json.dumps(row.as_dict()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
