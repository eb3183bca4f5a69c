"""``vlm-kv sweep --task multimodal``: the multimodal benchmark over policies x budgets, resumable.

    vlm-kv sweep --task multimodal --model smollava --data-seed 1 --items 20 [--tasks single,multi_turn] \\
                 [--images real|noise] --policies snapkv,dbtrimkv --budgets 0.05,0.1,0.25 --out DIR

Writes ``DIR/sweep_multimodal.json`` (``{"task", "settings", "rows"}``, one row per (policy,
budget, task) with the fields of ``vlm_kv.eval.multimodal.ROW_FIELDS``; the full cache's rows
have policy ``full``), ``sweep_multimodal.csv`` and ``sweep_multimodal_accuracy.png`` (accuracy
relative to the full cache against the budget, a panel per task). A rerun with the same ``--out``
keeps finished rows and retries rows that ended in an error; other settings in the same folder
are refused.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Sequence

from tqdm.auto import tqdm

from vlm_kv.eval.multimodal import FULL, ROW_FIELDS, MultimodalBench, settings_dict
from vlm_kv.eval.sweep_table import atomic_write, clean
from vlm_kv.policies import policy_spec

TABLE = "sweep_multimodal"


def row_key(policy: str, budget, task: str) -> str:
    return f"{policy}|{json.dumps(budget)}|{task}"


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _write(out: Path, state: dict) -> None:
    state = clean(state)
    atomic_write(out / f"{TABLE}.json", json.dumps(state, indent=1) + "\n")
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=[*ROW_FIELDS, "turn_accuracy", "seconds"], extrasaction="ignore")
    writer.writeheader()
    for row in state["rows"]:
        writer.writerow({k: json.dumps(v) if isinstance(v, list) else v for k, v in row.items()})
    atomic_write(out / f"{TABLE}.csv", buf.getvalue())


def run_multimodal_sweep(bench: MultimodalBench, policies: Sequence[str], budgets: Sequence, out_dir,
                         *, model_name: str, progress: bool = True, plots: bool = True) -> list[dict]:
    """The full cache's rows and every (policy, budget, task) row of ``bench``; returns the rows."""
    if not policies or not budgets:
        raise ValueError("a sweep needs at least one policy and one budget")
    # kvzip scores a context by having the model repeat it as text; an image cannot be read back,
    # and a plain forward would leave it unscored (it raises mid-sweep): refuse before any cell runs
    unreadable = [p for p in policies if p != FULL and policy_spec(p).needs_reconstruction]
    if unreadable:
        raise ValueError(f"{', '.join(unreadable)} scores the context by reading it back as text, which image "
                         "contexts cannot be; the multimodal task does not run it (use --task retrieval)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = clean({**settings_dict(bench.settings), "model": model_name, "cache_kwargs": bench.cache_kwargs})
    state = _load(out / f"{TABLE}.json")
    if state and (state.get("task") != "multimodal" or state.get("settings") != settings):
        old = state.get("settings") or {}
        diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
        raise ValueError(f"{out / (TABLE + '.json')} holds a sweep with other settings ({', '.join(diff)}); "
                         "use another --out")
    done = {row_key(r["policy"], r["budget"], r["task"]): r for r in state.get("rows", []) if not r.get("error")}
    cells = [(FULL, 1.0)] + [(p, b) for p in policies for b in budgets]
    todo = [(p, b, t) for p, b in cells for t in bench.settings.tasks if row_key(p, b, t) not in done]
    rows = dict(done)
    bar = tqdm(total=len(cells) * len(bench.settings.tasks), initial=len(cells) * len(bench.settings.tasks) - len(todo),
               desc="sweep multimodal", unit="row", disable=not progress)
    mine = [row_key(p, b, t) for p, b in cells for t in bench.settings.tasks]
    # rows of earlier runs with other policies or budgets stay in the file, after this run's
    others = [r for r in state.get("rows", []) if row_key(r["policy"], r["budget"], r["task"]) not in mine]
    try:
        for policy, budget, task in todo:
            bar.set_postfix_str(f"{task}: {policy} @ {budget}")
            rows[row_key(policy, budget, task)] = bench.run_task(policy, budget, task)
            _write(out, {"task": "multimodal", "settings": settings,
                         "rows": [rows[k] for k in mine if k in rows] + others})
            bar.update(1)
    finally:
        bar.close()
    ordered = [rows[k] for k in mine]
    _write(out, {"task": "multimodal", "settings": settings, "rows": ordered + others})
    if plots:
        plot_relative_accuracy(ordered + [r for r in others if not r.get("error")], out / f"{TABLE}_accuracy.png")
    return clean(ordered)


def plot_relative_accuracy(rows: list[dict], path: Path) -> None:
    """Accuracy relative to the full cache against the budget: a line per policy, a panel per task."""
    # lazy: matplotlib is optional (the eval extra)
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib is optional (the eval extra)
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r["task"] for r in rows))
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        mine = [r for r in rows if r["task"] == task and r["policy"] != FULL and r.get("relative_accuracy") is not None]
        for policy in dict.fromkeys(r["policy"] for r in mine):
            pts = sorted((float(r["budget"]), r["relative_accuracy"]) for r in mine if r["policy"] == policy)
            ax.plot([b for b, _ in pts], [a for _, a in pts], marker="o", label=policy)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set(title=task, xlabel="budget (fraction of the full cache)", ylabel="accuracy / full cache's")
        ax.grid(alpha=0.3)
    if axes[0][-1].get_legend_handles_labels()[0]:  # none when the full cache answered nothing right
        axes[0][-1].legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
