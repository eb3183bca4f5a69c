"""The sweep's results table: row identity, JSON-safe values, ``sweep_<task>.json`` and ``.csv``.

JSON: ``{"task", "settings", "reference", "rows"}``; CSV: the same rows, scalar columns only
(policy, budget, the task's metrics first; the KV byte columns, seconds and error last).
Both are written atomically (temporary file, then rename) after every cell.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os
from pathlib import Path
from typing import Sequence

__all__ = ["FULL_ROW", "KV_COLUMNS", "KV_AT_END", "KV_AFTER_EVICTION", "FULL_AT_END", "FRACTION_AT_END", "budget_key", "clean", "load_table", "table_paths", "save_table",
           "finalize_row", "ordered_rows"]

FULL_ROW = ("full", 1.0)
# The KV byte columns of every task, one definition each, said by the name (key/value bytes only;
# for tasks of several runs, the mean over runs at the end, the max over runs after eviction):
KV_AT_END = "kv_bytes_at_end"                     # held when a run ends (the last token fed / generated)
KV_AFTER_EVICTION = "max_kv_bytes_after_eviction"  # most held right after an eviction step: what the budget bounds
FULL_AT_END = "full_kv_bytes_at_end"              # the full cache's kv_bytes_at_end (the reference row)
FRACTION_AT_END = "kv_fraction_at_end"            # kv_bytes_at_end / full_kv_bytes_at_end
KV_COLUMNS = (KV_AT_END, KV_AFTER_EVICTION, FULL_AT_END, FRACTION_AT_END)
# what the tasks call them (vlm_kv.eval.fidelity, retrieval, the KV meter of mathvision / mmdu)
_TASK_KV_KEYS = {"kv_bytes": KV_AT_END, "max_kv_bytes": KV_AFTER_EVICTION, "held_bytes": "held_bytes_at_end"}


def budget_key(policy: str, budget) -> str:
    """Row identity: ``policy@budget`` with the budget as JSON writes it (0.25 vs 256 vs 1.0)."""
    return f"{policy}@{json.dumps(budget)}"


def clean(value):
    """JSON-safe copy: NaN / inf -> None, tuples -> lists, tensors' items -> numbers, config
    dataclasses (CacheOptions, TierConfig) -> dicts of their fields."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return clean(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 1) == 0:
        return clean(value.item())
    return value


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)



def table_paths(out: Path, task: str) -> tuple[Path, Path]:
    """(``sweep_<task>.json``, ``sweep_<task>.csv``) in ``out``."""
    return out / f"sweep_{task}.json", out / f"sweep_{task}.csv"


def load_table(json_path: str | os.PathLike) -> dict:
    p = Path(json_path)
    if not p.exists():
        return {}
    with open(p, encoding="utf-8") as fh:
        return json.load(fh)


def _budget_sort(budget) -> tuple:
    return (isinstance(budget, int) and not isinstance(budget, bool), float(budget))


def _csv_columns(task, rows: list[dict]) -> list[str]:
    first = ["policy", "budget"] + [m.key for m in task.metrics]
    tail = list(KV_COLUMNS) + ["seconds", "error"]
    cols = list(first)
    for row in rows:
        for k, v in row.items():
            if k in cols or k in tail or isinstance(v, (dict, list)):
                continue
            cols.append(k)
    return cols + [c for c in tail if c not in cols]


def save_table(task, json_path: Path, csv_path: Path, state: dict) -> None:
    state = clean(state)
    atomic_write(json_path, json.dumps(state, indent=2, ensure_ascii=False) + "\n")
    rows = state["rows"]
    cols = _csv_columns(task, rows)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for row in rows:
        w.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in cols})
    atomic_write(csv_path, buf.getvalue())



def finalize_row(row: dict, policy: str, budget, reference: dict | None, seconds: float | None) -> dict:
    """A task's row as a table row: its KV bytes under the table's column names (``KV_COLUMNS``),
    the full cache's from ``reference`` (None: this row is the reference)."""
    out = {"policy": policy, "budget": budget}
    for k, v in row.items():
        if k not in ("policy", "budget", "full_kv_bytes"):
            out[_TASK_KV_KEYS.get(k, k)] = v
    kv = out.get(KV_AT_END)
    full = kv if reference is None else reference.get(KV_AT_END, row.get("full_kv_bytes"))
    out[FULL_AT_END] = full
    out[FRACTION_AT_END] = (kv / full) if kv is not None and full else None
    if seconds is not None:
        out["seconds"] = round(seconds, 3)
    out.setdefault("error", None)
    return out



def ordered_rows(rows, policies: Sequence[str]) -> list[dict]:
    order = {p: i for i, p in enumerate(policies)}
    return sorted(rows, key=lambda r: (order.get(r["policy"], len(order)), r["policy"], _budget_sort(r["budget"])))

