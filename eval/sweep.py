"""Policies x budgets sweeps: one results table and plots per task.

    result = run_sweep(task, policies=["snapkv", "streaming_llm"], budgets=[0.1, 0.25], out_dir="runs/sweep")

``task`` is one of :class:`FidelityTask`, :class:`RetrievalTask`, :class:`MathVisionTask`,
:class:`MMDUTask` (``vlm-kv sweep`` builds them from the command line). The sweep first runs
the task once with the full cache (the *reference*, stored apart from the grid rows), then each
(policy, budget) cell, and writes after every cell:

``sweep_<task>.json``
    ``{"task", "settings", "reference", "rows"}``: one row per (policy, budget) with the task's
    metrics, ``kv_bytes`` (held after the run), ``max_kv_bytes``, ``full_kv_bytes``,
    ``kv_fraction``, ``seconds`` and ``error`` (null when fine).
``sweep_<task>.csv``
    the same rows, scalar columns only.
``sweep_<task>_<metric>_vs_budget.png`` / ``sweep_<task>_<metric>_vs_kv_bytes.png``
    one line per policy, the full cache as a dashed horizontal line (and a star at its bytes).

Resumable: rows already in the JSON are skipped on rerun (rows recorded with an error, e.g. a
gated policy without gates, are tried again); rerunning with other task settings in the same
folder is refused. A ``ValueError`` from one cell (missing gates, impossible budget) is recorded
in that row; other exceptions stop the sweep with the finished rows kept.
"""

from __future__ import annotations

import csv
import gc
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

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
]

TASKS = ("fidelity", "retrieval", "mathvision", "mmdu")
FULL_ROW = ("full", 1.0)
_KV_COLUMNS = ("kv_bytes", "max_kv_bytes", "full_kv_bytes", "kv_fraction")


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    higher_is_better: bool = True
    ylim: tuple[float, float] | None = None  # fixed y range for the plots (accuracies: 0..1)


# ----------------------------------------------------------------------------- small helpers


def budget_key(policy: str, budget) -> str:
    """Row identity: ``policy@budget`` with the budget as JSON writes it (0.25 vs 256 vs 1.0)."""
    return f"{policy}@{json.dumps(budget)}"


def _clean(value):
    """JSON-safe copy: NaN / inf -> None, tuples -> lists, tensors' items -> numbers."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 1) == 0:
        return _clean(value.item())
    return value


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _cache_bytes(cache) -> tuple[int, int]:
    from vlm_kv.eval.retrieval import cache_bytes

    return cache_bytes(cache)


def _free_memory() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # pragma: no cover
        pass


class _CacheMeter:
    """A ``make_cache`` wrapper that records the bytes each finished cache held.

    Keeps only the newest cache alive: a cache is measured when the next one is made (the
    runners make one per problem / dialog) or at :meth:`close`. Empty caches (the runners'
    settings check) are not counted.
    """

    def __init__(self):
        self.held: list[int] = []
        self.peak: list[int] = []
        self._last = None

    def _collect(self) -> None:
        cache, self._last = self._last, None
        if cache is None:
            return
        try:
            seen = cache.get_seq_length()
        except Exception:  # noqa: BLE001 - an unfilled DynamicCache layer
            seen = 0
        if seen:
            held, peak = _cache_bytes(cache)
            self.held.append(held)
            self.peak.append(peak)

    def make(self, model, policy, budget, **kwargs):
        from vlm_kv.api import make_cache

        self._collect()
        cache = make_cache(model, policy=policy, budget=budget, **kwargs)
        if not hasattr(cache, "kv_bytes"):  # the full cache: report its bytes like the others
            cache = _MeteredDynamicCache.wrap(cache)
        self._last = cache
        return cache

    def close(self) -> dict:
        self._collect()
        if not self.held:
            return {"kv_bytes": None, "max_kv_bytes": None}
        return {"kv_bytes": int(round(sum(self.held) / len(self.held))), "max_kv_bytes": max(self.peak)}


class _MeteredDynamicCache:
    """Mixin factory: a DynamicCache that also answers ``kv_bytes()`` like the compressed caches."""

    _classes: dict = {}

    @classmethod
    def wrap(cls, cache):
        base = type(cache)
        sub = cls._classes.get(base)
        if sub is None:

            def kv_bytes(self):
                total = 0
                for layer in getattr(self, "layers", []):
                    for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                        if hasattr(t, "nbytes"):
                            total += int(t.nbytes)
                return {"total": total}

            sub = type(f"Metered{base.__name__}", (base,), {"kv_bytes": kv_bytes})
            cls._classes[base] = sub
        cache.__class__ = sub
        return cache


# ----------------------------------------------------------------------------- tasks


class FidelityTask:
    """KL(full || compressed), top-1 agreement and NLL on real text (``vlm_kv.fidelity``).

    The full-cache log-probs are computed once per process and shared by every cell.
    """

    name = "fidelity"
    metrics = (
        Metric("kl", "KL(full || compressed), nats/token", higher_is_better=False),
        Metric("top1", "top-1 agreement with the full cache"),
    )

    def __init__(self, model, tokenizer, text_path: str, context: int, continuation: int, *, offset: int = 0,
                 model_name: str | None = None, cache_kwargs: dict | None = None, progress: bool = False):
        self.model, self.tokenizer = model, tokenizer
        self.text_path, self.context, self.continuation, self.offset = str(text_path), context, continuation, offset
        self.model_name = model_name
        self.cache_kwargs = dict(cache_kwargs or {})
        self.progress = progress
        self._ids = None
        self._ref = None

    def settings(self) -> dict:
        return {"model": self.model_name, "text": os.path.abspath(self.text_path), "offset": self.offset,
                "context": self.context, "continuation": self.continuation, "cache_kwargs": self.cache_kwargs}

    def _reference(self):
        if self._ref is None:
            from vlm_kv.fidelity import run_reference, text_tokens

            self._ids = text_tokens(self.tokenizer, self.text_path, self.offset,
                                    self.context + self.continuation + 1)
            self._ref = run_reference(self.model, self._ids, self.context, self.progress)
        return self._ref

    def reference(self) -> dict:
        logps, nbytes = self._reference()
        targets = self._ids[0, self.context + 1:]
        nll = float(-logps.gather(1, targets[:, None]).mean())
        return {"kl": 0.0, "top1": 1.0, "nll": nll, "full_nll": nll, "kv_bytes": int(nbytes),
                "max_kv_bytes": int(nbytes), "context": self.context, "continuation": int(targets.numel())}

    def run(self, policy: str, budget) -> dict:
        from vlm_kv.fidelity import measure

        ref = self._reference()
        r = measure(self.model, self._ids, self.context, policy, budget, ref, self.progress, **self.cache_kwargs)
        row = r.as_dict()
        row.pop("policy"), row.pop("budget")
        return row


class RetrievalTask:
    """Planted-fact retrieval (``vlm_kv.eval.retrieval``); the full-cache answers are shared."""

    name = "retrieval"
    metrics = (Metric("accuracy", "planted-fact retrieval accuracy (exact match)", ylim=(0.0, 1.0)),)

    def __init__(self, model, tokenizer, text_path: str, context: int, *, depths: Sequence[float] = (0.1, 0.5, 0.9),
                 trials: int = 3, offset: int = 0, seed: int = 0, max_new_tokens: int = 16,
                 model_name: str | None = None, cache_kwargs: dict | None = None, progress: bool = False):
        self.model, self.tokenizer = model, tokenizer
        self.text_path, self.context = str(text_path), context
        self.depths, self.trials, self.offset, self.seed = [float(d) for d in depths], trials, offset, seed
        self.max_new_tokens = max_new_tokens
        self.model_name = model_name
        self.cache_kwargs = dict(cache_kwargs or {})
        self.progress = progress
        self._ref: dict | None = None

    def settings(self) -> dict:
        return {"model": self.model_name, "text": os.path.abspath(self.text_path), "offset": self.offset,
                "context": self.context, "depths": self.depths, "trials": self.trials, "seed": self.seed,
                "max_new_tokens": self.max_new_tokens, "cache_kwargs": self.cache_kwargs}

    def _kw(self) -> dict:
        return dict(depths=self.depths, trials=self.trials, offset=self.offset, seed=self.seed,
                    max_new_tokens=self.max_new_tokens, progress=self.progress)

    def use_reference(self, row: dict) -> None:
        """A reference row stored by an earlier run (its ``records`` carry the full-cache answers)."""
        if row.get("records"):
            self._ref = row

    def reference(self) -> dict:
        from vlm_kv.eval.retrieval import retrieval

        self._ref = retrieval(self.model, self.tokenizer, self.text_path, self.context, "full", 1.0, **self._kw())
        return _strip_policy(self._ref)

    def run(self, policy: str, budget) -> dict:
        from vlm_kv.eval.retrieval import retrieval

        if self._ref is None:
            self.reference()
        r = retrieval(self.model, self.tokenizer, self.text_path, self.context, policy, budget,
                      reference=self._ref, **self._kw(), **self.cache_kwargs)
        return _strip_policy(r)


def _strip_policy(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in ("policy", "budget")}


class _LazyModel:
    """Loads (model, processor) on first use; ``release()`` drops them (e.g. before a judge loads)."""

    def __init__(self, load: Callable[[], tuple]):
        self._load = load
        self.pair: tuple | None = None

    def get(self) -> tuple:
        if self.pair is None:
            self.pair = self._load()
        return self.pair

    def release(self) -> None:
        self.pair = None
        _free_memory()


def _cell_dir(root: Path, policy: str, budget) -> Path:
    return root / f"{policy}_{json.dumps(budget)}"


class MathVisionTask:
    """MathVision generation + the authors' scoring (``vlm_kv.eval.mathvision_run``), one folder per cell.

    ``load``: returns (model, processor), called once when the first cell needs it.
    Metric: the ``-all`` accuracy as a fraction; ``kv_bytes`` is the mean over the problems
    generated by the call that finished the cell.
    """

    name = "mathvision"
    metrics = (Metric("accuracy", "MathVision accuracy (-all)", ylim=(0.0, 1.0)),)

    def __init__(self, load: Callable[[], tuple], problems, out_dir: str | os.PathLike, *, prompt_style: str = "authors",
                 max_new_tokens: int = 4096, model_name: str | None = None, data: str | None = None,
                 cache_kwargs: dict | None = None, progress: bool = False):
        self.model = _LazyModel(load)
        self.problems = list(problems)
        self.root = Path(out_dir) / "mathvision"
        self.prompt_style, self.max_new_tokens = prompt_style, max_new_tokens
        self.model_name, self.data = model_name, data
        self.cache_kwargs = dict(cache_kwargs or {})
        self.progress = progress

    def settings(self) -> dict:
        return {"model": self.model_name, "data": self.data, "n_problems": len(self.problems),
                "prompt": self.prompt_style, "max_new_tokens": self.max_new_tokens, "cache_kwargs": self.cache_kwargs}

    def reference(self) -> dict:
        return self.run(*FULL_ROW)

    def run(self, policy: str, budget) -> dict:
        from vlm_kv.eval.mathvision_run import run_mathvision

        model, processor = self.model.get()
        meter = _CacheMeter()
        folder = _cell_dir(self.root, policy, budget)
        summary = run_mathvision(
            model, processor, self.problems, policy=policy, budget=budget, out_dir=folder,
            prompt_style=self.prompt_style, max_new_tokens=self.max_new_tokens,
            make_cache=lambda m, policy, budget, **kw: meter.make(m, policy, budget, **kw),
            cache_kwargs=self.cache_kwargs, progress=self.progress,
            config_extra={"model": self.model_name, "data": self.data},
        )
        n = summary.n_problems
        return {
            "accuracy": (summary.n_correct / n) if n else None,
            "accuracy_all": summary.result.get("-all"),
            "n_problems": n,
            "n_correct": summary.n_correct,
            "n_errors": summary.n_errors,
            **meter.close(),
            "run_dir": str(folder),
        }


class MMDUTask:
    """MMDU dialogs on one cache per dialog (``vlm_kv.eval.mmdu_run``), one folder per cell.

    Answers are generated cell by cell with the VLM; with a judge (a folder or a callable), the
    VLM is released afterwards and the judge scores every cell in one pass (:meth:`finish`).
    Metrics: the judge's ``Overall Score`` (x10, "all" average) and ROUGE-L against the references.
    ``kv_bytes``: mean over answered turns of the cache's bytes after the turn.
    """

    name = "mmdu"
    resume_free = ("judge",)  # answer with --no-judge first, judge later in the same folder

    def __init__(self, load: Callable[[], tuple], data, out_dir: str | os.PathLike, *, judge: Any = None,
                 judge_kwargs: dict | None = None, max_new_tokens: int = 2048, model_name: str | None = None,
                 cache_kwargs: dict | None = None, progress: bool = False):
        self.model = _LazyModel(load)
        self.data = data
        self.root = Path(out_dir) / "mmdu"
        self.judge = judge
        self.judge_kwargs = dict(judge_kwargs or {})
        self.max_new_tokens = max_new_tokens
        self.model_name = model_name
        self.cache_kwargs = dict(cache_kwargs or {})
        self.progress = progress
        overall = Metric("overall", "MMDU overall score (judge, x10)")
        rouge = Metric("rouge_l", "ROUGE-L vs reference answers")
        self.metrics = (overall, rouge) if judge is not None else (rouge,)

    def _judge_label(self):
        if self.judge is None:
            return None
        if isinstance(self.judge, (str, os.PathLike)):
            return os.path.abspath(str(self.judge))
        from vlm_kv.eval.mmdu_judge import judge_name

        return judge_name(self.judge).get("name")

    def settings(self) -> dict:
        return {"model": self.model_name, "data": getattr(self.data, "path", None),
                "n_dialogs": len(self.data.dialogs), "max_new_tokens": self.max_new_tokens,
                "judge": self._judge_label(), "cache_kwargs": self.cache_kwargs}

    def reference(self) -> dict:
        return self.run(*FULL_ROW)

    def run(self, policy: str, budget) -> dict:
        from vlm_kv.eval.mmdu_run import generate_answers, summarize

        model, processor = self.model.get()
        folder = _cell_dir(self.root, policy, budget)
        meter = _CacheMeter()
        generate_answers(
            model, processor, self.data, folder, policy=policy, budget=budget, max_new_tokens=self.max_new_tokens,
            config={"model": self.model_name}, cache_factory=meter.make, cache_kwargs=self.cache_kwargs,
            progress=self.progress,
        )
        meter.close()
        return self._row(summarize(folder, self.data), folder, judged=False)

    def needs_finish(self, row: dict) -> bool:
        return self.judge is not None and not row.get("judged") and not row.get("error")

    def finish(self, rows: list[dict]) -> None:
        """Judge every cell (the reference included) that is not judged yet; updates rows in place."""
        from vlm_kv.eval.mmdu_judge import LocalJudge, judge_name
        from vlm_kv.eval.mmdu_run import judge_answers, summarize

        todo = [r for r in rows if self.needs_finish(r)]
        if not todo:
            return
        judge = self.judge
        if isinstance(judge, (str, os.PathLike)):
            self.model.release()  # the answering model and the judge rarely fit together
            judge = self.judge = LocalJudge(judge, **self.judge_kwargs)
        info = judge_name(judge)
        ids = [d.id for d in self.data.dialogs]
        for row in todo:
            folder = Path(row["run_dir"])
            judge_answers(judge, folder, dialog_ids=ids, progress=self.progress)
            row.update(self._row(summarize(folder, self.data, judge_info=info), folder, judged=True))

    def _row(self, summary: dict, folder: Path, judged: bool) -> dict:
        scores = (summary.get("scores") or {}).get("all") or {}
        kv = summary.get("kv_bytes") or {}
        return {
            "overall": (scores.get("Overall Score") if judged else None),
            "rouge_l": summary.get("rouge_l"),
            "scores_all": scores or None,
            "n_questions": summary.get("n_questions"),
            "n_answered": summary.get("n_answered"),
            "n_judged": summary.get("n_judged"),
            "n_parse_failures": summary.get("n_parse_failures"),
            "kv_bytes": kv.get("mean_per_turn_total"),
            "max_kv_bytes": kv.get("max_per_turn_total"),
            "judged": judged,
            "run_dir": str(folder),
        }


# ----------------------------------------------------------------------------- the sweep


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


def _paths(out: Path, task: str) -> tuple[Path, Path]:
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
    tail = list(_KV_COLUMNS) + ["seconds", "error"]
    cols = list(first)
    for row in rows:
        for k, v in row.items():
            if k in cols or k in tail or isinstance(v, (dict, list)):
                continue
            cols.append(k)
    return cols + [c for c in tail if c not in cols]


def _save(task, json_path: Path, csv_path: Path, state: dict) -> None:
    state = _clean(state)
    _atomic_write(json_path, json.dumps(state, indent=2, ensure_ascii=False) + "\n")
    rows = state["rows"]
    cols = _csv_columns(task, rows)
    import io

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for row in rows:
        w.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in cols})
    _atomic_write(csv_path, buf.getvalue())


def _finalize(row: dict, policy: str, budget, reference: dict | None, seconds: float | None) -> dict:
    out = {"policy": policy, "budget": budget}
    out.update({k: v for k, v in row.items() if k not in ("policy", "budget")})
    full = (reference or {}).get("kv_bytes")
    if full is not None:
        out["full_kv_bytes"] = full
    kv = out.get("kv_bytes")
    out["kv_fraction"] = (kv / out["full_kv_bytes"]) if kv is not None and out.get("full_kv_bytes") else None
    if seconds is not None:
        out["seconds"] = round(seconds, 3)
    out.setdefault("error", None)
    return out


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
    json_path, csv_path = _paths(out, task.name)
    settings = _clean(task.settings())
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

    from tqdm.auto import tqdm

    total = len(grid) + 1
    bar = tqdm(total=total, initial=total - len(todo) - int(need_ref), desc=f"sweep {task.name}",
               unit="run", disable=not progress)
    errors: list[tuple[str, str]] = []
    try:
        if need_ref:
            bar.set_postfix_str("full cache")
            t0 = time.perf_counter()
            ref = _finalize(task.reference(), *FULL_ROW, None, time.perf_counter() - t0)
            ref["full_kv_bytes"], ref["kv_fraction"] = ref.get("kv_bytes"), 1.0 if ref.get("kv_bytes") else None
            state["reference"] = ref
            _save(task, json_path, csv_path, state)
            bar.update(1)
        for policy, budget in todo:
            bar.set_postfix_str(f"{policy} @ {budget}")
            t0 = time.perf_counter()
            try:
                row = task.run(policy, budget)
            except ValueError as exc:  # missing gates, impossible budget, unknown policy
                row = {**{m.key: None for m in task.metrics}, "error": f"{type(exc).__name__}: {exc}"}
                errors.append((budget_key(policy, budget), row["error"]))
            row = _finalize(row, policy, budget, ref, time.perf_counter() - t0)
            by_key[budget_key(policy, budget)] = row
            state["rows"] = _ordered(by_key.values(), policies)
            _save(task, json_path, csv_path, state)
            bar.update(1)
    finally:
        bar.close()

    needs_finish = getattr(task, "needs_finish", None)
    if needs_finish is not None and any(needs_finish(r) for r in [ref, *state["rows"]] if r):
        task.finish([r for r in [ref, *state["rows"]] if r])
        for r in state["rows"]:
            r.update(_finalize(r, r["policy"], r["budget"], ref, None))
        _save(task, json_path, csv_path, state)

    state = _clean(state)
    pngs = write_plots(task, state, out) if plots else []
    for r in state["rows"]:
        if r.get("error") and (budget_key(r["policy"], r["budget"]), r["error"]) not in errors:
            errors.append((budget_key(r["policy"], r["budget"]), r["error"]))
    return SweepResult(json_path, csv_path, pngs, state["reference"], state["rows"],
                       n_run=len(todo), n_skipped=len(grid) - len(todo), errors=errors)


def _ordered(rows, policies: Sequence[str]) -> list[dict]:
    order = {p: i for i, p in enumerate(policies)}
    return sorted(rows, key=lambda r: (order.get(r["policy"], len(order)), r["policy"], _budget_sort(r["budget"])))


# ----------------------------------------------------------------------------- plots


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
        import warnings

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
            kv_values = [float(r["kv_bytes"]) for r in rows if r.get("kv_bytes") is not None]
            if ref.get("kv_bytes") is not None:
                kv_values.append(float(ref["kv_bytes"]))
            scale, unit = _bytes_unit(kv_values)
            for policy in policies:
                pts = []
                for r in rows:
                    y = r.get(metric.key)
                    x = r.get("budget") if axis == "budget" else r.get("kv_bytes")
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
                if axis == "kv_bytes" and ref.get("kv_bytes") is not None:
                    ax.plot([float(ref["kv_bytes"]) / scale], [float(ref_y)], marker="*", markersize=12,
                            color="black", linestyle="none")
            if axis == "budget":
                ax.set_xlabel(_budget_label([r["budget"] for r in rows]))
            else:
                ax.set_xlabel(f"KV cache held ({unit})")
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
