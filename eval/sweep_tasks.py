"""The tasks a sweep runs: each measures one (policy, budget) cell and the full-cache reference.

A task has ``name``, ``metrics`` (:class:`Metric`), ``settings()`` (what a resumed table must
match), ``reference()`` and ``run(policy, budget)`` returning a row dict; optionally
``use_reference(row)``, ``resume_free`` and ``needs_finish`` / ``finish`` (MMDU's judge pass).
"""

from __future__ import annotations

import gc
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from vlm_kv.eval.diagnostics import DiagnosticColumns
from vlm_kv.eval.fidelity import measure, run_reference, text_tokens
from vlm_kv.eval.kv_meter import CacheMeter
from vlm_kv.eval.mathvision_run import free_accelerator_memory, run_mathvision
from vlm_kv.eval.mmdu_judge import LocalJudge, judge_name
from vlm_kv.eval.mmdu_run import generate_answers, judge_answers, summarize
from vlm_kv.eval.retrieval import RetrievalSettings, retrieval
from vlm_kv.eval.sweep_table import FULL_ROW

__all__ = ["Metric", "FidelityTask", "RetrievalTask", "MathVisionTask", "MMDUTask", "TASKS"]

TASKS = ("fidelity", "retrieval", "mathvision", "mmdu")


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    higher_is_better: bool = True
    ylim: tuple[float, float] | None = None  # fixed y range for the plots (accuracies: 0..1)



def _free_memory() -> None:
    gc.collect()
    free_accelerator_memory()



class FidelityTask:
    """KL(full || compressed), top-1 agreement and NLL on real text (``vlm_kv.eval.fidelity``).

    The full-cache log-probs are computed once per process and shared by every cell. With
    ``diagnostics`` each row also gets the future missed mass, churn and LIR of the cell's
    eviction decisions (``vlm_kv.eval.diagnostics``, default window / horizon / m; the full
    cache's attention is recorded once).
    """

    name = "fidelity"
    metrics = (
        Metric("kl", "KL(full || compressed), nats/token", higher_is_better=False),
        Metric("top1", "top-1 agreement with the full cache"),
    )

    def __init__(self, model, tokenizer, text_path: str, context: int, continuation: int, *, offset: int = 0,
                 model_name: str | None = None, cache_kwargs: dict | None = None, progress: bool = False,
                 diagnostics: bool = False):
        self.model, self.tokenizer = model, tokenizer
        self.text_path, self.context, self.continuation, self.offset = str(text_path), context, continuation, offset
        self.model_name = model_name
        self.cache_kwargs = dict(cache_kwargs or {})
        self.progress = progress
        self._ids = None
        self._ref = None
        self.diagnostics = None
        if diagnostics:
            self.diagnostics = DiagnosticColumns()
            self.metrics = FidelityTask.metrics + self.diagnostics.metrics(Metric)

    def settings(self) -> dict:
        out = {"model": self.model_name, "text": os.path.abspath(self.text_path), "offset": self.offset,
               "context": self.context, "continuation": self.continuation, "cache_kwargs": self.cache_kwargs}
        if self.diagnostics is not None:
            out["diagnostics"] = self.diagnostics.settings()
        return out

    def _reference(self):
        if self._ref is None:
            self._ids = text_tokens(self.tokenizer, self.text_path, self.offset,
                                    self.context + self.continuation + 1)
            self._ref = run_reference(self.model, self._ids, self.context, self.progress)
        return self._ref

    def reference(self) -> dict:
        logps, nbytes = self._reference()
        targets = self._ids[0, self.context + 1:]
        nll = float(-logps.gather(1, targets[:, None]).mean())
        row = {"kl": 0.0, "top1": 1.0, "nll": nll, "full_nll": nll, "kv_bytes": int(nbytes),
               "max_kv_bytes": int(nbytes), "context": self.context, "continuation": int(targets.numel())}
        if self.diagnostics is not None:
            row.update(self.diagnostics.full_cache_row())
        return row

    def run(self, policy: str, budget) -> dict:
        ref = self._reference()
        factory, finish = None, None
        if self.diagnostics is not None:
            factory, finish = self.diagnostics.prepare(self.model, self._ids, self.context, policy, budget,
                                                       self.cache_kwargs, self.progress)
        r = measure(self.model, self._ids, self.context, policy, budget, ref, self.progress,
                    cache_factory=factory, **self.cache_kwargs)
        row = r.as_dict()
        row.pop("policy"), row.pop("budget")
        if finish is not None:
            row.update(finish())
        return row


class RetrievalTask:
    """Planted-fact retrieval (``vlm_kv.eval.retrieval``); the full-cache answers are shared."""

    name = "retrieval"
    metrics = (Metric("accuracy", "planted-fact retrieval accuracy (exact match)", ylim=(0.0, 1.0)),)

    def __init__(self, model, tokenizer, text_path: str, settings: RetrievalSettings, *,
                 model_name: str | None = None, cache_kwargs: dict | None = None, progress: bool = False):
        self.model, self.tokenizer = model, tokenizer
        self.text_path, self.trial_settings = str(text_path), settings
        self.model_name = model_name
        self.cache_kwargs = dict(cache_kwargs or {})
        self.progress = progress
        self._ref: dict | None = None
        self._reconstruction: dict = {}  # kvzip's scores by context, shared by every budget of a sweep

    def settings(self) -> dict:
        s = self.trial_settings
        out = {"model": self.model_name, "text": os.path.abspath(self.text_path), "offset": s.offset,
               "context": s.context, "depths": list(s.depths), "trials": s.trials, "seed": s.seed,
               "max_new_tokens": s.max_new_tokens, "cache_kwargs": self.cache_kwargs}
        if s.ask != "prompt":  # only when set, so sweeps written before ask existed still resume
            out["ask"] = s.ask
        return out

    def use_reference(self, row: dict) -> None:
        """A reference row stored by an earlier run (its ``records`` carry the full-cache answers)."""
        if row.get("records"):
            self._ref = row

    def reference(self) -> dict:
        self._ref = retrieval(self.model, self.tokenizer, self.text_path, "full", 1.0, self.trial_settings,
                              progress=self.progress)
        return _strip_policy(self._ref)

    def run(self, policy: str, budget) -> dict:
        if self._ref is None:
            self.reference()
        r = retrieval(self.model, self.tokenizer, self.text_path, policy, budget, self.trial_settings,
                      reference=self._ref, progress=self.progress, reconstruction_memo=self._reconstruction,
                      **self.cache_kwargs)
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


def _options_for(policy: str, cache_kwargs: dict) -> dict:
    """The sweep's cache options for one cell: the full-cache reference takes none (it compresses nothing)."""
    return {} if policy == FULL_ROW[0] else cache_kwargs


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
        model, processor = self.model.get()
        meter = CacheMeter()
        folder = _cell_dir(self.root, policy, budget)
        summary = run_mathvision(
            model, processor, self.problems, policy=policy, budget=budget, out_dir=folder,
            prompt_style=self.prompt_style, max_new_tokens=self.max_new_tokens,
            make_cache=lambda m, policy, budget, **kw: meter.make(m, policy, budget, **kw),
            cache_kwargs=_options_for(policy, self.cache_kwargs), progress=self.progress,
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

        return judge_name(self.judge).get("name")

    def settings(self) -> dict:
        return {"model": self.model_name, "data": getattr(self.data, "path", None),
                "n_dialogs": len(self.data.dialogs), "max_new_tokens": self.max_new_tokens,
                "judge": self._judge_label(), "cache_kwargs": self.cache_kwargs}

    def reference(self) -> dict:
        return self.run(*FULL_ROW)

    def run(self, policy: str, budget) -> dict:
        model, processor = self.model.get()
        folder = _cell_dir(self.root, policy, budget)
        meter = CacheMeter()
        generate_answers(
            model, processor, self.data, folder, policy=policy, budget=budget, max_new_tokens=self.max_new_tokens,
            config={"model": self.model_name}, cache_factory=meter.make, cache_kwargs=_options_for(policy, self.cache_kwargs),
            progress=self.progress,
        )
        meter.close()
        return self._row(summarize(folder, self.data), folder, judged=False)

    def needs_finish(self, row: dict) -> bool:
        return self.judge is not None and not row.get("judged") and not row.get("error")

    def finish(self, rows: list[dict]) -> None:
        """Judge every cell (the reference included) that is not judged yet; updates rows in place."""

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
            scored = self._row(summarize(folder, self.data, judge_info=info), folder, judged=True)
            # the row's KV byte columns were set when it was answered; judging does not move them
            row.update({k: v for k, v in scored.items() if k not in ("kv_bytes", "max_kv_bytes")})

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
            "max_kv_bytes": kv.get("max_after_eviction"),
            "judged": judged,
            "run_dir": str(folder),
        }

