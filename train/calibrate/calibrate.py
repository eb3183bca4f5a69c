"""Offline calibration of a PolyKV strategy: which pattern each layer prefers, how much it needs.

Our procedure (the PolyKV paper's code is not public):

1. Reference: for each calibration window (``context`` tokens prefilled, ``continuation`` fed
   one at a time) the full cache's next-token log-probs and final hidden states, computed once
   and shared by every probe.
2. Pattern preference per (layer, phase): a probe switches one layer to one candidate and
   measures the mean KL(full || probe) of the next-token distributions and the mean cosine of
   the final hidden state. The other layers of a probe either keep their full cache
   (``baseline=None``, the single-layer probe) or are all compressed to the global budget by the
   ``baseline`` pattern (leave-one-out against a compressed baseline: closer to deployment,
   where every layer is compressed and layers interact). The lowest KL wins (cosine breaks
   ties); with a baseline, a layer leaves the baseline pattern only when another candidate
   lowers the KL by more than ``margin`` (relative to the baseline's KL). The prefill phase is
   calibrated first (the candidate evicts in both phases); the decode phase then varies the
   decode pattern with the layer's prefill pattern fixed.
3. Budget sensitivity per layer: the same probe with the chosen pattern at other budgets
   (``sensitivity`` multiples of the global budget, below and/or above 1); a layer's
   sensitivity is the slope of its KL curve, (KL at the smallest multiple - KL at the largest)
   / (largest - smallest), at least 0: how much KL a unit of budget buys. The global budget goes
   ``floor_ratio`` evenly to every layer (the floor) and the rest in proportion to sensitivity
   (``budget_source="probes"``) or to the entries the model's DBTrimKV gates keep per layer at
   the global budget (``budget_source="gates"``), no layer above its full cache.
4. Modality shares per layer, on image data only (``images=``: MathVision-style problems or
   conversations, one window per problem or per chat up to its first answer, the full cache's
   greedy continuation fed one token at a time; :mod:`vlm_kv.train.calibrate.data`): with the
   layer's chosen pattern at its share, how much the KL grows when the layer keeps less of one
   modality; see :mod:`vlm_kv.train.calibrate.modality`. Text data give no modality shares.
5. Attention entropy per layer (mean over heads of the entropy of the last ``entropy_queries``
   prefill queries, full cache, normalised by log of the keys each query sees) is recorded as a
   signal beside the sensitivity, with their Spearman rank correlation (does diffuse attention
   predict sensitivity?); it does not enter the shares.

Cheap by construction: short windows (512 + 32 tokens by default), one shared reference, few
budgets; with a baseline the candidate equal to the baseline needs no probe per layer (it is
the baseline run, measured once). Every measurement is saved to a JSON progress
file as soon as it finishes; a rerun with the same settings reloads it and measures only what
is missing, so the result is the same whether or not the run was interrupted.
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import DynamicCache

from vlm_kv.api import _resolve_gates, cache_kwarg, make_cache
from vlm_kv.attention.reference import attention_probs
from vlm_kv.cache.cache import CompressedCache
from vlm_kv.cache.hooks import attach
from vlm_kv.config import Budget, CacheOptions
from vlm_kv.eval.fidelity import text_tokens
from vlm_kv.eval.mathvision_prompt import PROMPT_STYLES
from vlm_kv.models.adapters import get_adapter
from vlm_kv.policies import normalize_policy_name, policy_spec
from vlm_kv.policies.base import Scorer
from vlm_kv.policies.polykv import split_capacity
from vlm_kv.policies.strategy import (
    MODALITIES,
    PHASES,
    LayerEntry,
    Strategy,
    StrategyError,
)
from vlm_kv.storage.allocation import Uniform
from vlm_kv.train.calibrate.data import image_windows
from vlm_kv.train.calibrate.modality import (
    calibrate_modalities,
    present_modalities,
    probes_per_layer,
)
from vlm_kv.train.calibrate.probes import (
    Window,
    feed,
    feed_token,
    probe_cache,
    probe_strategy,
)

#: pattern of the layers a probe leaves full (it never evicts there; this one observes nothing)


#: settings that choose from the measurements, or which ones to take, without changing any
#: measurement (every measurement is keyed by layer, pattern(s) and budget multiple)
CHOICE_SETTINGS = ("margin", "floor_ratio", "candidates", "sensitivity", "phases", "budget_pattern", "budget_source",
                   "modality_factor", "modality_floor")
#: settings of image data only (they are part of a progress file's settings only for image data,
#: so text progress files written before them still resume)
IMAGE_SETTINGS = ("min_pixels", "max_pixels", "prompt_style")
BUDGET_SOURCES = ("probes", "gates")


@dataclass
class CalibrationConfig:
    budget: float                               # global budget the strategy is for (fraction)
    candidates: list[str]                       # patterns each layer may choose from
    phases: list[str] = field(default_factory=lambda: ["prefill"])
    context: int = 512                          # tokens prefilled per window
    continuation: int = 32                      # tokens fed one at a time after it
    windows_per_file: int = 1
    sensitivity: list[float] = field(default_factory=lambda: [0.5])  # budget multiples probed besides 1
    floor_ratio: float = 0.5                    # share of the budget spread evenly (the floor)
    evict_every: int = 16
    seed: int = 0
    baseline: str | None = None                 # pattern of the other layers in a probe (None: full cache)
    margin: float = 0.0                         # relative KL gain needed to leave the baseline pattern
    entropy_queries: int = 64                   # prefill queries per window the entropy signal averages
    budget_pattern: str = "chosen"              # pattern probed for sensitivity: "chosen" or "baseline"
    budget_source: str = "probes"               # shares from the probes' sensitivity, or from the gates' top-k
    modality_factor: float = 0.5                # a modality probe multiplies that modality's share by this
    modality_floor: float = 0.05                # least share of a layer's budget any modality present gets
    min_pixels: int | None = None               # image data: pixel limits of each image (default: the processor's)
    max_pixels: int | None = None
    prompt_style: str = "authors"               # image data: MathVision prompt style

    def check(self) -> "CalibrationConfig":
        if not 0.0 < self.budget < 1.0:
            raise ValueError(f"--budget must be a fraction in (0, 1), got {self.budget}")
        if not self.candidates:
            raise ValueError("no candidate patterns")
        self.candidates = [normalize_policy_name(c) for c in self.candidates]
        for c in self.candidates:
            if c in ("full", "polykv"):
                raise ValueError(f"candidate {c!r} is not an eviction pattern")
        kinds = {policy_spec(c).gate_kind for c in self.candidates} - {None}
        if len(kinds) > 1:
            raise ValueError(f"gated candidates need one gate kind per calibration, got {sorted(kinds)}")
        if len(set(self.candidates)) != len(self.candidates):
            raise ValueError(f"duplicate candidates: {self.candidates}")
        bad = [p for p in self.phases if p not in PHASES]
        if bad or not self.phases or self.phases[0] != "prefill" or len(set(self.phases)) != len(self.phases):
            raise ValueError(f"--phases must be 'prefill' or 'prefill,decode', got {','.join(self.phases)}")
        if self.context < 2 or self.continuation < 1:
            raise ValueError("context must be >= 2 tokens and continuation >= 1")
        if not self.sensitivity or not all(0.0 < m <= 1.0 / self.budget and m != 1.0 for m in self.sensitivity):
            raise ValueError(f"sensitivity multiples must be in (0, 1/budget] and not 1, got {self.sensitivity}")
        if self.baseline is not None:
            self.baseline = normalize_policy_name(self.baseline)
            if self.baseline not in self.candidates:
                raise ValueError(f"--baseline {self.baseline!r} must be one of the candidates {self.candidates}")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"margin must be in [0, 1), got {self.margin}")
        if self.margin and self.baseline is None:
            raise ValueError("a margin is measured against the baseline pattern: give --baseline")
        if self.budget_source not in BUDGET_SOURCES:
            raise ValueError(f"budget_source must be one of {BUDGET_SOURCES}, got {self.budget_source!r}")
        if self.budget_pattern not in ("chosen", "baseline"):
            raise ValueError(f"budget_pattern must be 'chosen' or 'baseline', got {self.budget_pattern!r}")
        if self.budget_pattern == "baseline" and self.baseline is None:
            raise ValueError("budget_pattern 'baseline' needs --baseline")
        if self.entropy_queries < 1:
            raise ValueError(f"entropy_queries must be >= 1, got {self.entropy_queries}")
        if not 0.0 <= self.floor_ratio <= 1.0:
            raise ValueError(f"floor_ratio must be in [0, 1], got {self.floor_ratio}")
        if not 0.0 < self.modality_factor < 1.0:
            raise ValueError(f"modality_factor must be in (0, 1), got {self.modality_factor}")
        if not 0.0 <= self.modality_floor < 1.0 / len(MODALITIES):
            raise ValueError(f"modality_floor must be in [0, 1/{len(MODALITIES)}), got {self.modality_floor}")
        for name in ("min_pixels", "max_pixels"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be a positive number of pixels, got {value}")
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels {self.min_pixels} is larger than max_pixels {self.max_pixels}")

        if self.prompt_style not in PROMPT_STYLES:
            raise ValueError(f"prompt_style must be one of {PROMPT_STYLES}, got {self.prompt_style!r}")
        return self


def calibration_windows(tokenizer, paths: list[str], config: CalibrationConfig) -> list[Window]:
    """Windows of ``context + continuation + 1`` tokens at seeded character offsets of each file."""

    rng = random.Random(config.seed)
    need = config.context + config.continuation + 1
    windows = []
    for path in paths:
        size = os.path.getsize(path)
        if size == 0:
            raise ValueError(f"calibration file {path} is empty")
        # leave about 6 characters per token after the offset
        last = max(0, size - need * 6)
        for _ in range(config.windows_per_file):
            offset = rng.randint(0, last) if last else 0
            windows.append(Window(os.path.basename(path), offset, text_tokens(tokenizer, path, offset, need),
                                  context=config.context))
    return windows


@torch.no_grad()
def _greedy_reference(model, window: Window) -> None:
    """Full-cache reference of an image window: its greedy continuation of ``window.generate``
    tokens (appended to ``window.ids``, with the token that follows them; never an image or video
    placeholder) and, for each, the next-token log-probs and final hidden state, exactly what
    :func:`feed` measures on them."""
    adapter = get_adapter(model)
    # a vision placeholder fed without its pixels would be an image entry with a text embedding
    banned = [t for t in (adapter.image_token_id, adapter.video_token_id) if t is not None]

    def greedy(logits: torch.Tensor) -> torch.Tensor:
        last = logits[:, -1:].clone()
        last[..., banned] = float("-inf")
        return last.argmax(-1)

    arg = {cache_kwarg(model): DynamicCache(config=model.config)}
    out = model(input_ids=window.ids[:, : window.context], **window.inputs, **arg, use_cache=True)
    token = greedy(out.logits)
    fed, logps, hidden = [], [], []
    for _ in range(window.generate):
        fed.append(token)
        lp, h, logits = feed_token(model, arg, token)
        logps.append(lp)
        hidden.append(h)
        token = greedy(logits)
    window.ids = torch.cat([window.ids[:, : window.context], *fed, token], dim=1)
    window.ref_logps, window.ref_hidden = torch.stack(logps), torch.stack(hidden)


class _EntropyRecorder(Scorer):
    """Observes a full-cache prefill and records, per layer, the mean attention entropy of the
    last ``queries`` queries (each query's entropy divided by log of the keys it sees, so 1 is
    uniform attention over its past and 0 one key), averaged over heads. It never evicts."""

    def __init__(self, num_layers: int, queries: int) -> None:
        self.queries = queries
        self.per_layer: list[list[float]] = [[] for _ in range(num_layers)]
        self._layers = [_EntropyLayer(self, i) for i in range(num_layers)]

    def for_layer(self, layer_idx: int) -> Scorer:
        return self._layers[layer_idx]



class _EntropyLayer(Scorer):
    def __init__(self, owner: _EntropyRecorder, layer_idx: int) -> None:
        self.owner, self.layer_idx = owner, layer_idx

    def score(self, ctx) -> torch.Tensor:
        # budget 1.0 keeps everything whatever the scores
        return torch.zeros(ctx.view.positions.shape, dtype=torch.float32)

    def observe(self, store, query, view, query_positions, scaling) -> None:
        if query.shape[2] < 2:
            return  # decode steps: the signal is the prefill's
        q = min(self.owner.queries, query.shape[2])
        probs = attention_probs(query[:, :, -q:], view, query_positions[-q:], scaling)  # [B, H, g, Q, L]
        ent = -(probs * probs.clamp_min(1e-30).log()).sum(-1)                          # [B, H, g, Q]
        keys = (query_positions[-q:].double() - view.positions.min().double() + 1).clamp_min(2)
        self.owner.per_layer[self.layer_idx].append(float((ent.double() / keys.log()).mean()))


@torch.no_grad()
def attention_entropy(model, ids: torch.Tensor, context: int, queries: int, inputs: dict | None = None) -> list[float]:
    """Per-layer normalised attention entropy of the prefill of ``ids[:, :context]`` (full cache;
    ``inputs``: vision tensors of an image prompt)."""
    adapter = attach(model)
    recorder = _EntropyRecorder(adapter.num_layers, queries)
    cache = CompressedCache(adapter, recorder, Uniform(), Budget(fraction=1.0), options=CacheOptions(evict_every=1 << 30),
                            policy_name="entropy-probe", model_id=id(model))
    model(input_ids=ids[:, :context], **(inputs or {}), **{cache_kwarg(model): cache}, use_cache=True)
    return [sum(v) / len(v) if v else float("nan") for v in recorder.per_layer]


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman rank correlation (average ranks for ties)."""
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va and vb else float("nan")


def allocate(sensitivity: list[float], budget: float, floor_ratio: float) -> tuple[list[float], float]:
    """Per-layer budgets (whole-cache units, summing to ``budget``) and the floor: ``floor_ratio``
    of the budget evenly, the rest proportional to sensitivity, none above a full layer (1/L)."""

    n = len(sensitivity)
    floor = floor_ratio * budget / n
    # split in fine integer units with the same water-filling the cache uses at run time
    units = 10**9
    weights = [max(s, 0.0) + 1e-12 for s in sensitivity]
    limit = int(round((1.0 / n - floor) * units))
    extra = split_capacity(int(round((budget - n * floor) * units)), weights, limit)
    budgets = [floor + e / units for e in extra]
    scale = budget / sum(budgets)  # rounding residue only
    return [b * scale for b in budgets], floor * min(scale, 1.0)


class Calibrator:
    """Runs the measurements of one calibration, resumable through ``progress_path``."""

    def __init__(self, model, tokenizer, data: list[str], config: CalibrationConfig,
                 progress_path: str | None = None, show_progress: bool = True,
                 log: Callable[[str], None] | None = None, only_measured: bool = False,
                 gates=None, images: str | None = None) -> None:
        """``gates``: a folder or RetentionGates module for gated candidates (default: the gates
        shipped for the model). ``images``: the folder the image paths of the JSONL ``data``
        (MathVision-style problems or conversations) are relative to; then ``tokenizer`` is the
        model's processor, each window is one problem or chat prompt (its greedy continuation) and the layers' modality shares are
        calibrated too (:mod:`vlm_kv.train.calibrate.modality`)."""
        self.only_measured = only_measured
        self.model = model
        self.config = config.check()
        self.fingerprint = get_adapter(model).fingerprint()
        self.num_layers = self.fingerprint["num_layers"]
        self.data = list(data)
        self.images = images
        if images is None:
            given = [n for n in ("min_pixels", "max_pixels") if getattr(self.config, n) is not None]
            if given:
                raise ValueError(f"{', '.join(given)} apply to image data: give the images folder (--images DIR)")
            self.windows = calibration_windows(tokenizer, self.data, self.config)
        else:
            self.windows = image_windows(model, tokenizer, self.data, images, self.config)

        # modality shares are calibrated on image data only (text data: one modality, as before)
        self.modalities = present_modalities(self.windows) if images is not None else ["text"]
        self.progress_path = progress_path
        self.show_progress = show_progress
        self.log = log or (lambda msg: None)
        # choice settings only decide from the measurements: a progress file serves any of them;
        # settings that do not apply to the data stay out (text progress files keep resuming)
        self._unused = ("context",) if images is not None else IMAGE_SETTINGS + ("modality_factor", "modality_floor")
        measured = {k: v for k, v in asdict(self.config).items() if k not in CHOICE_SETTINGS + self._unused}
        self.settings = {"model": self.fingerprint, "data": [os.path.basename(p) for p in self.data],
                         "config": measured}
        if images is not None:
            self.settings["images"] = os.path.basename(os.path.normpath(images))
        self.gates = None
        self._gates_arg = gates
        self._share_gates = gates if gates is not None and not isinstance(gates, str) else None
        kinds = {policy_spec(c).gate_kind for c in self.config.candidates} - {None}
        if kinds:
            kind = kinds.pop()
            self.gates = _resolve_gates(model, gates, kind, "polykv")
            if kind == "dbtrimkv":
                self._share_gates = self.gates
            self.settings["gates"] = gates if isinstance(gates, str) else f"{kind} ({'given' if gates else 'shipped'})"
        self.results: dict[str, dict[str, float]] = {}
        self.seconds = 0.0
        self._entropy: list[float] | None = None
        self._load_progress()

    # ------------------------------------------------------------ progress file
    def _load_progress(self) -> None:
        if not self.progress_path or not os.path.isfile(self.progress_path):
            return
        with open(self.progress_path) as fh:
            saved = json.load(fh)
        if saved.get("settings") != json.loads(json.dumps(self.settings)):
            raise StrategyError(f"{self.progress_path} holds measurements of another calibration (other model, data "
                                "or settings); remove it or choose another --out")
        self.results = saved["results"]
        self.seconds = saved.get("seconds", 0.0)
        self.log(f"resuming: {len(self.results)} measurements reloaded from {self.progress_path}")

    def _save_progress(self) -> None:
        if not self.progress_path:
            return
        tmp = self.progress_path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"settings": self.settings, "results": self.results, "seconds": self.seconds}, fh, indent=0)
        os.replace(tmp, self.progress_path)

    # ------------------------------------------------------------ measurements
    def _reference(self) -> None:
        for w in self.windows:
            if w.ref_logps is None and w.generate:
                _greedy_reference(self.model, w)
            elif w.ref_logps is None:
                w.ref_logps, w.ref_hidden = feed(self.model, DynamicCache(config=self.model.config), w.ids,
                                                  w.context, w.inputs)

    def entropy(self) -> list[float]:
        """Per-layer attention entropy averaged over the windows (full cache, prefill)."""
        if self._entropy is None:
            per_window = [attention_entropy(self.model, w.ids, w.context, self.config.entropy_queries, w.inputs)
                          for w in self.windows]
            self._entropy = [sum(col) / len(col) for col in zip(*per_window)]
        return self._entropy

    def gate_entries(self) -> list[float]:
        """Entries per layer that the model's DBTrimKV retention gates keep at the global budget
        (one global top-k over all layers), at the end of each window, averaged over windows.
        The gates learned which layers need their entries: their split is a budget profile."""
        key = "gate_entries|dbtrimkv"
        if key not in self.results:
            if self.only_measured:
                raise StrategyError(f"measurement {key!r} is not in {self.progress_path}; run without --only-measured")

            if self._share_gates is None:
                self._share_gates = _resolve_gates(self.model, self._gates_arg, "dbtrimkv", "polykv")
            self._reference()  # image windows: their continuation
            start = time.perf_counter()
            rows = []
            for w in self.windows:
                cache = make_cache(self.model, policy="dbtrimkv", budget=self.config.budget, gates=self._share_gates,
                                   options=CacheOptions(evict_every=self.config.evict_every, seed=self.config.seed))
                feed(self.model, cache, w.ids, w.context, w.inputs)
                rows.append([layer.store.num_entries() for layer in cache.layers])
            self.seconds += time.perf_counter() - start
            self.results[key] = {"entries": [sum(col) / len(col) for col in zip(*rows)]}
            self._save_progress()
        return self.results[key]["entries"]

    @staticmethod
    def key(layer: int, phase: str, pattern: str, multiple: float, prefill_pattern: str | None = None) -> str:
        head = f"{layer}|{phase}|{pattern}|{multiple:g}"
        return head if prefill_pattern is None else f"{head}|after:{prefill_pattern}"

    def measure(self, layer: int, patterns: dict[str, str], multiple: float) -> dict[str, float]:
        """KL and cosine of one probe, averaged over the windows."""
        self._reference()
        cfg = self.config
        start = time.perf_counter()
        strategy = probe_strategy(self.fingerprint, self.num_layers, layer, cfg.budget * multiple, patterns,
                                  cfg.baseline, cfg.budget if cfg.baseline else 1.0)
        kls, coss = [], []
        for w in self.windows:
            cache = probe_cache(self.model, strategy, cfg.evict_every, cfg.seed, self.gates)
            logps, hidden = feed(self.model, cache, w.ids, w.context, w.inputs)
            kls.append(float(F.kl_div(logps, w.ref_logps, log_target=True, reduction="none").sum(-1).mean()))
            coss.append(float(F.cosine_similarity(hidden, w.ref_hidden, dim=-1).mean()))
        self.seconds += time.perf_counter() - start
        return {"kl": sum(kls) / len(kls), "cos": sum(coss) / len(coss)}

    def _get(self, key: str, layer: int, patterns: dict[str, str], multiple: float, bar) -> dict[str, float]:
        return self._get_measured(key, lambda: self.measure(layer, patterns, multiple), bar)

    def _get_measured(self, key: str, measure: Callable[[], dict], bar) -> dict:
        """The measurement ``key``: reloaded, or measured now and saved at once."""
        if key not in self.results:
            if self.only_measured:
                raise StrategyError(f"measurement {key!r} is not in {self.progress_path}; run without "
                                    "--only-measured to measure it")
            self.results[key] = measure()
            self._save_progress()
        bar.update(1)
        return self.results[key]

    def _choose(self, scores: dict[str, dict[str, float]]) -> str:
        cands = self.config.candidates
        best = min(cands, key=lambda c: (scores[c]["kl"], -scores[c]["cos"], cands.index(c)))
        base = self.config.baseline
        if base is not None and best != base and scores[best]["kl"] > scores[base]["kl"] * (1 - self.config.margin):
            return base  # not a clear enough gain over the baseline pattern
        return best

    def _curve(self, layer: int, pats: dict[str, str], at_one: float, bar) -> dict[float, float]:
        """KL of ``layer`` at every sensitivity multiple with ``pats`` (its value at 1 given)."""
        same = pats["prefill"] == pats.get("decode", pats["prefill"])
        curve = {1.0: at_one}
        for m in self.config.sensitivity:
            if same:
                key, probe = self.key(layer, "prefill", pats["prefill"], m), {"prefill": pats["prefill"]}
            else:
                key, probe = self.key(layer, "decode", pats["decode"], m, pats["prefill"]), pats
            curve[m] = self._get(key, layer, probe, m, bar)["kl"]
        return curve

    def run(self) -> Strategy:
        cfg = self.config
        L, cands, base = self.num_layers, cfg.candidates, cfg.baseline
        probed = len(cands) - (1 if base else 0)
        total = (1 if base else 0) + L * probed + L * (len(cfg.phases) - 1) * (len(cands) - 1) \
            + L * len(cfg.sensitivity)
        with_modality = len(self.modalities) > 1
        if with_modality:
            total += L * probes_per_layer(self.modalities)
        bar = tqdm(total=total, desc="calibrate", disable=not self.show_progress, unit="probe")
        base_score = self._get(f"baseline|{base}", 0, {"prefill": base}, 1.0, bar) if base else None
        curves: dict[int, dict[float, float]] = {}
        if cfg.budget_pattern == "baseline":
            # budgets first: they need only the baseline, so an interrupted run already has them
            for layer in range(L):
                curves[layer] = self._curve(layer, {"prefill": base}, base_score["kl"], bar)
        chosen: dict[str, list[str]] = {}
        signals: list[dict] = [{} for _ in range(L)]
        scores: list[dict[str, dict[str, float]]] = [{} for _ in range(L)]
        # prefill: candidate by candidate over all layers (an interrupted run has whole candidates)
        for cand in cands:
            for layer in range(L):
                if cand == base:
                    scores[layer][cand] = base_score  # the layer keeps the baseline: the baseline run
                else:
                    key = self.key(layer, "prefill", cand, 1.0)
                    scores[layer][cand] = self._get(key, layer, {"prefill": cand}, 1.0, bar)
        chosen["prefill"] = [self._choose(scores[layer]) for layer in range(L)]
        for layer in range(L):
            signals[layer]["prefill"] = {"kl": {c: scores[layer][c]["kl"] for c in cands},
                                         "cos": {c: scores[layer][c]["cos"] for c in cands},
                                         "chosen": chosen["prefill"][layer]}
        if "decode" in cfg.phases:
            picks = []
            for layer in range(L):
                first = chosen["prefill"][layer]
                dec = {}
                for cand in cands:
                    if cand == first:
                        dec[cand] = scores[layer][first]
                        continue
                    key = self.key(layer, "decode", cand, 1.0, first)
                    dec[cand] = self._get(key, layer, {"prefill": first, "decode": cand}, 1.0, bar)
                best = self._choose(dec)
                picks.append(best)
                signals[layer]["decode"] = {"kl": {c: dec[c]["kl"] for c in cands},
                                            "cos": {c: dec[c]["cos"] for c in cands}, "chosen": best}
            chosen["decode"] = picks
        else:
            chosen["decode"] = chosen["prefill"]
        sensitivity = []
        for layer in range(L):
            if cfg.budget_pattern == "chosen":
                pats = {"prefill": chosen["prefill"][layer], "decode": chosen["decode"][layer]}
                phase = "prefill" if pats["prefill"] == pats["decode"] else "decode"
                curves[layer] = self._curve(layer, pats, signals[layer][phase]["kl"][pats[phase]], bar)
            curve = curves[layer]
            lo, hi = min(curve), max(curve)
            slope = max(0.0, (curve[lo] - curve[hi]) / (hi - lo))
            signals[layer]["kl_by_budget_multiple"] = {f"{m:g}": v for m, v in sorted(curve.items())}
            signals[layer]["sensitivity"] = slope
            sensitivity.append(slope)
        entropy = self.entropy()
        for layer in range(L):
            signals[layer]["attention_entropy"] = entropy[layer]
        extra = {}
        if cfg.budget_source == "gates":
            weights = self.gate_entries()
            for layer in range(L):
                signals[layer]["gate_entries"] = weights[layer]
            extra = {"entropy_vs_gate_entries_spearman": spearman(entropy, weights),
                     "sensitivity_vs_gate_entries_spearman": spearman(sensitivity, weights)}
        else:
            weights = sensitivity
        budgets, floor = allocate(weights, cfg.budget, cfg.floor_ratio)
        shares: list[dict | None] = [None] * L
        if with_modality:
            for layer, (split, why) in enumerate(calibrate_modalities(self, chosen, budgets, bar)):
                shares[layer] = split
                signals[layer]["modality"] = why
        bar.close()
        layers = {phase: [LayerEntry(chosen[phase][i], budgets[i], modality=dict(shares[i]) if shares[i] else None,
                                     signals=signals[i] if phase == "prefill" else {})
                          for i in range(L)] for phase in cfg.phases}
        if "decode" in cfg.phases:
            for i in range(L):
                layers["decode"][i].signals = {"see": "prefill entry of this layer"}
        others = "full" if base is None else f"compressed to the global budget by {base}"
        calibration = {
            "data": [w.describe() for w in self.windows],
            "method": f"one layer switched to a candidate at a time, the other layers {others}; KL of next-token "
                      "distributions and cosine of the final hidden state vs one shared full-cache reference"
                      + (f"; the baseline pattern kept unless a candidate lowers KL by more than {cfg.margin:g} of it"
                         if base else "")
                      + f"; sensitivity = slope of KL over the probed budget multiples (pattern: {cfg.budget_pattern})"
                      + ("; shares = floor + rest proportional to sensitivity" if cfg.budget_source == "probes" else
                         "; shares = floor + rest proportional to the entries DBTrimKV's gates keep per layer"),
            **{k: v for k, v in asdict(cfg).items() if k not in ("budget", "candidates") + self._unused},
            **(self._image_description() if self.images is not None else {}),
            "baseline_kl": base_score["kl"] if base_score else None,
            "entropy_vs_sensitivity_spearman": spearman(entropy, sensitivity),
            **extra,
            "measurements": len(self.results),
            "measure_seconds": round(self.seconds, 1),
        }
        return Strategy(model=self.fingerprint, budget=cfg.budget, layers=layers, floor=floor,
                        candidates=list(cands), calibration=calibration).validate()

    def _image_description(self) -> dict:
        """What the image data was, for the strategy's ``calibration`` record."""
        n = len(self.windows)
        described = {
            "images": {"folder": self.images, "files": [os.path.basename(p) for p in self.data], "windows": n,
                       "images": len({(w.source, w.info.get("image")) for w in self.windows}),
                       "image_tokens": sum(w.info.get("image_tokens", 0) for w in self.windows),
                       "prompt_tokens": sum(w.context for w in self.windows),
                       "continuation": "greedy tokens of the full cache, fed one at a time"},
            "modalities": list(self.modalities),
        }
        if len(self.modalities) > 1:
            described["modality_method"] = (
                "per layer, with its chosen pattern at its calibrated share: the split of the entries it keeps "
                "alone (start shares), KL with them imposed, and KL with each modality's share times "
                f"{self.config.modality_factor:g} (the others absorbing it); shares = start x sensitivity, "
                f"normalised, floor {self.config.modality_floor:g} each (train/calibrate/modality.py)")
        return described


def calibrate(model, tokenizer, data: list[str], config: CalibrationConfig, progress_path: str | None = None,
              show_progress: bool = True, only_measured: bool = False, gates=None,
              images: str | None = None) -> Strategy:
    """A PolyKV strategy for ``model`` calibrated on the text files ``data`` (see module docstring);
    ``only_measured``: choose from the measurements in ``progress_path`` and measure nothing;
    ``gates``: for gated candidates (trimkv, dbtrimkv), a folder or module (default: shipped);
    ``images``: ``data`` are JSONL files (problems or conversations) whose image paths are relative to this
    folder, ``tokenizer`` is the model's processor, and every layer gets modality shares too."""
    return Calibrator(model, tokenizer, data, config, progress_path, show_progress,
                      only_measured=only_measured, gates=gates, images=images).run()


def plot_strategy(strategy: Strategy, path: str) -> None:
    """PNG: per layer, its budget (as a fraction of its own cache) coloured by pattern, per phase;
    below each phase whose entries carry modality shares, the shares per layer (stacked)."""
    # lazy: matplotlib is optional (the eval extra)
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib is optional (the eval extra)
    import matplotlib.pyplot as plt

    phases = list(strategy.layers)
    names = sorted(strategy.patterns())
    colours = {n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(names)}
    with_shares = [p for p in phases if any(e.modality for e in strategy.layers[p])]
    rows = [(phase, "budget") for phase in phases] + [(phase, "modality") for phase in with_shares]
    fig, axes = plt.subplots(len(rows), 1, figsize=(max(6, strategy.num_layers * 0.3), 2.8 * len(rows)),
                             squeeze=False)
    L = strategy.num_layers
    for ax, (phase, kind) in zip(axes[:, 0], rows):
        entries = strategy.layers[phase]
        ax.set_xticks(range(L))
        if kind == "modality":
            _plot_modality_shares(ax, entries, phase)
            continue
        fractions = [e.budget * L for e in entries]
        ax.bar(range(L), fractions, color=[colours[e.pattern] for e in entries])
        ax.axhline(strategy.budget, color="grey", linestyle="--", linewidth=1)
        ax.set_ylabel("kept fraction of layer")
        ax.set_title(f"{phase}: pattern and budget per layer (global budget {strategy.budget:g}, dashed)")
    axes[-1, 0].set_xlabel("layer")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[n]) for n in names]
    fig.legend(handles, names, loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


#: one colour per modality in the strategy plot (text grey, image orange, video blue)
_MODALITY_COLOURS = {"text": "#9e9e9e", "image": "#ff7f0e", "video": "#1f77b4"}


def _plot_modality_shares(ax, entries: list[LayerEntry], phase: str) -> None:
    """Stacked bars of each layer's modality shares (a layer without shares: an empty column)."""
    bottom = [0.0] * len(entries)
    for m in MODALITIES:
        heights = [(e.modality or {}).get(m, 0.0) for e in entries]
        if any(heights):
            ax.bar(range(len(entries)), heights, bottom=bottom, color=_MODALITY_COLOURS[m], label=m)
            bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_ylim(0, 1)
    ax.set_ylabel("share of layer budget")
    ax.set_title(f"{phase}: modality shares per layer")
    ax.legend(loc="lower left", fontsize=8)
