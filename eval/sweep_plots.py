"""Sweep plots: per metric, one PNG against the budget and one against the KV bytes held.

One line per policy; the full cache is a dashed horizontal line (and a star at its bytes).
A metric spanning more than 20x between rows (KL) gets a log axis.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from vlm_kv.eval.sweep_table import KV_AT_END

__all__ = ["write_plots"]


def _bytes_unit(values: list[float]) -> tuple[float, str]:
    top = max(values) if values else 0
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if top >= scale:
            return float(scale), unit
    return 1.0, "bytes"


def _budget_label(budgets: list) -> str:
    if budgets and all(isinstance(b, int) and not isinstance(b, bool) and b != 1 for b in budgets):
        return "budget (tokens per KV head)"
    if budgets and all(isinstance(b, float) or b == 1 for b in budgets):
        return "budget (fraction of the full cache)"
    return "budget (fraction of the full cache, or tokens per KV head)"


def write_plots(task, state: dict, out_dir: str | os.PathLike) -> list[Path]:
    """Two PNGs per metric: metric vs budget and metric vs KV bytes; returns their paths."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        warnings.warn("matplotlib is not installed (pip install 'vlm-kv[eval]'): sweep plots skipped",
                      RuntimeWarning, stacklevel=2)
        return []
    out = Path(out_dir)
    rows = [r for r in state.get("rows") or [] if not r.get("error")]
    ref = state.get("reference") or {}
    settings = state.get("settings") or {}
    shown = dict(settings)
    if isinstance(shown.get("model"), str):
        shown["model"] = os.path.basename(os.path.normpath(shown["model"])) or shown["model"]
    subtitle = ", ".join(f"{k} {shown[k]}" for k in ("model", "context", "continuation", "n_problems",
                                                     "n_dialogs") if shown.get(k) is not None)
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    paths: list[Path] = []
    for metric in task.metrics:
        for axis in ("budget", "kv_bytes"):
            fig = Figure(figsize=(9.0, 4.8), dpi=110)
            FigureCanvasAgg(fig)
            ax = fig.add_subplot(1, 1, 1)
            kv_values = [float(r[KV_AT_END]) for r in rows if r.get(KV_AT_END) is not None]
            if ref.get(KV_AT_END) is not None:
                kv_values.append(float(ref[KV_AT_END]))
            scale, unit = _bytes_unit(kv_values)
            for policy in policies:
                pts = []
                for r in rows:
                    y = r.get(metric.key)
                    x = r.get("budget") if axis == "budget" else r.get(KV_AT_END)
                    if r["policy"] != policy or y is None or x is None:
                        continue
                    pts.append((float(x) if axis == "budget" else float(x) / scale, float(y)))
                if pts:
                    pts.sort()
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy)
            ref_y = ref.get(metric.key)
            ys = [float(r[metric.key]) for r in rows if r.get(metric.key) is not None]
            # KL spans decades between good and bad policies: a log axis keeps the good ones apart
            log_axis = metric.ylim is None and ys and min(ys) > 0 and max(ys) / min(ys) > 20
            if log_axis:
                ax.set_yscale("log")
                if ref_y is not None and float(ref_y) <= 0:
                    ax.plot([], [], color="black", linestyle="--", label=f"full cache ({float(ref_y):g}, off the log axis)")
                    ref_y = None
            if ref_y is not None:
                ax.axhline(float(ref_y), color="black", linestyle="--", linewidth=1.2, label="full cache")
                if axis == "kv_bytes" and ref.get(KV_AT_END) is not None:
                    ax.plot([float(ref[KV_AT_END]) / scale], [float(ref_y)], marker="*", markersize=12,
                            color="black", linestyle="none")
            if axis == "budget":
                ax.set_xlabel(_budget_label([r["budget"] for r in rows]))
            else:
                ax.set_xlabel(f"KV bytes at the end of a run ({unit})")
            better = "lower is better" if not metric.higher_is_better else "higher is better"
            ax.set_ylabel(f"{metric.label}\n({better})")
            title = f"{task.name}: {metric.key} vs {'budget' if axis == 'budget' else 'KV bytes'}"
            ax.set_title(f"{title}\n{subtitle}" if subtitle else title, fontsize=10)
            if metric.ylim is not None:
                lo, hi = metric.ylim
                pad = 0.03 * (hi - lo)
                ax.set_ylim(lo - pad, hi + pad)
            ax.grid(True, alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
            fig.tight_layout()
            path = out / f"sweep_{task.name}_{metric.key}_vs_{axis}.png"
            fig.savefig(path)
            paths.append(path)
    return paths
