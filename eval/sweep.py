"""Policies x budgets sweeps: one results table and plots per task.

    result = run_sweep(task, policies=["snapkv", "streaming_llm"], budgets=[0.1, 0.25], out_dir="runs/sweep")

``task`` is one of :class:`FidelityTask`, :class:`RetrievalTask`, :class:`MathVisionTask`,
:class:`MMDUTask` (``vlm-kv sweep`` builds them from the command line). The sweep first runs
the task once with the full cache (the *reference*, stored apart from the grid rows), then each
(policy, budget) cell, and writes after every cell:

``sweep_<task>.json``
    ``{"task", "settings", "reference", "rows"}``: one row per (policy, budget) with the task's
    metrics, the KV byte columns (``sweep_table.KV_COLUMNS``, the same for every task:
    ``kv_bytes_at_end``, ``max_kv_bytes_after_eviction``, ``full_kv_bytes_at_end``,
    ``kv_fraction_at_end``), ``seconds`` and ``error`` (null when fine).
``sweep_<task>.csv``
    the same rows, scalar columns only.
``sweep_<task>_<metric>_vs_budget.png`` / ``sweep_<task>_<metric>_vs_kv_bytes.png``
    one line per policy, the full cache as a dashed horizontal line (and a star at its bytes).

Resumable: rows already in the JSON are skipped on rerun (rows recorded with an error, e.g. a
gated policy without gates, are tried again); rerunning with other task settings in the same
folder is refused. A ``ValueError`` from one cell (missing gates, impossible budget) is recorded
in that row; other exceptions stop the sweep with the finished rows kept.

This module is the runner; the tasks live in ``sweep_tasks``, the table files in
``sweep_table``, the plots in ``sweep_plots`` and the KV byte meter in ``kv_meter``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from tqdm.auto import tqdm

from vlm_kv.eval.sweep_plots import write_plots
from vlm_kv.eval.sweep_table import (
    FULL_ROW,
    budget_key,
    clean,
    finalize_row,
    load_table,
    ordered_rows,
    save_table,
    table_paths,
)
from vlm_kv.eval.sweep_tasks import (
    TASKS,
    FidelityTask,
    MathVisionTask,
    Metric,
    MMDUTask,
    RetrievalTask,
)

__all__ = [
    "Metric",
    "SweepResult",
    "FidelityTask",
    "RetrievalTask",
    "MathVisionTask",
    "MMDUTask",
    "TASKS",
    "run_sweep",
    "write_plots",
    "budget_key",
    "load_table",
]


@dataclass
class SweepResult:
    json_path: Path
    csv_path: Path
    plots: list[Path]
    reference: dict | None
    rows: list[dict]
    n_run: int
    n_skipped: int
    errors: list[tuple[str, str]] = field(default_factory=list)



def run_sweep(
    task,
    policies: Sequence[str],
    budgets: Sequence[float | int],
    out_dir: str | os.PathLike,
    *,
    progress: bool = True,
    plots: bool = True,
) -> SweepResult:
    """Run ``task`` on the full cache once and on every (policy, budget); see the module docstring."""
    if not policies or not budgets:
        raise ValueError("a sweep needs at least one policy and one budget")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = table_paths(out, task.name)
    settings = clean(task.settings())
    state = load_table(json_path)
    if state:
        old = state.get("settings") or {}
        free = set(getattr(task, "resume_free", ()))  # settings a rerun may change (e.g. adding a judge)
        diff = [k for k in set(old) | set(settings) if k not in free and old.get(k) != settings.get(k)]
        if state.get("task") != task.name or diff:
            detail = ", ".join(f"{k}: {old.get(k)!r} there vs {settings.get(k)!r} now" for k in sorted(diff))
            raise ValueError(f"{json_path} holds a {state.get('task')} sweep with other settings ({detail}); "
                             "use another --out")
    state = {"task": task.name, "settings": settings, "reference": state.get("reference"),
             "rows": list(state.get("rows") or [])}

    grid = [(p, b) for p in policies for b in budgets]
    by_key = {budget_key(r["policy"], r["budget"]): r for r in state["rows"]}
    todo = [(p, b) for p, b in grid
            if budget_key(p, b) not in by_key or by_key[budget_key(p, b)].get("error")]
    ref = state["reference"]
    need_ref = ref is None or bool(ref.get("error"))
    if ref is not None and not need_ref and hasattr(task, "use_reference"):
        task.use_reference(ref)

    total = len(grid) + 1
    bar = tqdm(total=total, initial=total - len(todo) - int(need_ref), desc=f"sweep {task.name}",
               unit="run", disable=not progress)
    errors: list[tuple[str, str]] = []
    try:
        if need_ref:
            bar.set_postfix_str("full cache")
            t0 = time.perf_counter()
            ref = finalize_row(task.reference(), *FULL_ROW, None, time.perf_counter() - t0)
            state["reference"] = ref
            save_table(task, json_path, csv_path, state)
            bar.update(1)
        for policy, budget in todo:
            bar.set_postfix_str(f"{policy} @ {budget}")
            t0 = time.perf_counter()
            try:
                row = task.run(policy, budget)
            except ValueError as exc:  # missing gates, impossible budget, unknown policy
                row = {**{m.key: None for m in task.metrics}, "error": f"{type(exc).__name__}: {exc}"}
                errors.append((budget_key(policy, budget), row["error"]))
            row = finalize_row(row, policy, budget, ref, time.perf_counter() - t0)
            by_key[budget_key(policy, budget)] = row
            state["rows"] = ordered_rows(by_key.values(), policies)
            save_table(task, json_path, csv_path, state)
            bar.update(1)
    finally:
        bar.close()

    needs_finish = getattr(task, "needs_finish", None)
    if needs_finish is not None and any(needs_finish(r) for r in [ref, *state["rows"]] if r):
        task.finish([r for r in [ref, *state["rows"]] if r])
        for r in state["rows"]:
            r.update(finalize_row(r, r["policy"], r["budget"], ref, None))
        save_table(task, json_path, csv_path, state)

    state = clean(state)
    pngs = write_plots(task, state, out) if plots else []
    for r in state["rows"]:
        if r.get("error") and (budget_key(r["policy"], r["budget"]), r["error"]) not in errors:
            errors.append((budget_key(r["policy"], r["budget"]), r["error"]))
    return SweepResult(json_path, csv_path, pngs, state["reference"], state["rows"],
                       n_run=len(todo), n_skipped=len(grid) - len(todo), errors=errors)

