"""Per-modality budget shares of every layer (PolyKV ``LayerEntry.modality``), calibrated on
image data after the layers' patterns and budgets (our procedure; the PolyKV paper has none).

For each layer, with its chosen pattern(s) and its calibrated share of the budget (the other
layers as in the pattern probes: full, or compressed to the global budget by the baseline
pattern), averaged over the calibration windows:

1. free probe: the layer evicts by its pattern alone; the split of the entries it holds at the
   end of a window between modalities is the layer's start split ``s0`` (what the pattern keeps
   of each modality at this budget, the "share of the layer's entries");
2. start probe: the same layer with ``s0`` imposed as modality shares: KL_0;
3. one probe per modality m present in the data and in ``s0``: m's share multiplied by
   ``factor``, the others absorbing what it frees in proportion to theirs: KL_m. Sensitivity
   ``d_m = max(0, KL_m - KL_0) / (s0_m * (1 - factor))``, the KL added per unit of share taken;
4. shares: ``s0_m * d_m`` normalised (``s0`` itself when no modality moved the KL), then the
   floor: each present modality gets ``floor`` and the rest ``1 - n * floor`` in those
   proportions, so a modality the probes call useless is thinned, never dropped.

A modality absent from the calibration data gets no share (at run time its entries rank below
every entry within a share). Every probe is a keyed measurement of the calibrator's progress
file (layer, patterns, the layer's kept fraction, which probe), so an interrupted run resumes.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F

from vlm_kv.models.adapters import MODALITIES
from vlm_kv.train.calibrate.probes import feed, probe_cache, probe_strategy

__all__ = ["calibrate_modalities", "less_shares", "modality_shares", "present_modalities", "start_shares"]


def present_modalities(windows: list) -> list[str]:
    """Modalities with tokens in the windows' prompts (text always: questions and continuations)."""
    present = {"text"}
    for w in windows:
        present |= {m for m in MODALITIES if w.info.get(f"{m}_tokens", 0) > 0}
    return [m for m in MODALITIES if m in present]


def start_shares(kept: dict[str, float], present: list[str]) -> dict[str, float]:
    """The kept split over the present modalities, normalised (even if nothing was kept)."""
    split = {m: max(0.0, float(kept.get(m, 0.0))) for m in present}
    total = sum(split.values())
    return {m: v / total for m, v in split.items()} if total > 0 else {m: 1.0 / len(present) for m in present}


def less_shares(start: dict[str, float], modality: str, factor: float) -> dict[str, float]:
    """``start`` with ``modality``'s share times ``factor``; the others absorb the freed share in
    proportion to theirs (evenly when they all have none)."""
    if modality not in start or len(start) < 2:
        raise ValueError(f"taking share from {modality!r} needs it and another modality in {sorted(start)}")
    out = dict(start)
    freed = start[modality] * (1.0 - factor)
    out[modality] = start[modality] * factor
    others = [m for m in start if m != modality]
    weight = sum(start[m] for m in others)
    for m in others:
        out[m] += freed * (start[m] / weight if weight > 0 else 1.0 / len(others))
    return out


def modality_shares(start: dict[str, float], sensitivity: dict[str, float], floor: float) -> dict[str, float]:
    """Shares of the present modalities, summing to 1: ``start`` reweighted by ``sensitivity``
    (kept as it is when every sensitivity is 0), each at least ``floor``."""
    if not 0.0 <= floor * len(start) < 1.0:
        raise ValueError(f"a floor of {floor} for {len(start)} modalities leaves nothing to share")
    weights = {m: start[m] * max(0.0, sensitivity.get(m, 0.0)) for m in start}
    if sum(weights.values()) <= 0:
        weights = dict(start)
    total = sum(weights.values())
    rest = 1.0 - floor * len(start)
    return {m: floor + rest * w / total for m, w in weights.items()}


def measure_modality_probe(cal, layer: int, patterns: dict[str, str], fraction: float,
                           shares: dict[str, float] | None) -> dict[str, Any]:
    """KL, cosine and the split between modalities of the entries ``layer`` holds at the end of
    each window, for ``layer`` at ``fraction`` of its cache with ``patterns`` and ``shares``."""

    cal._reference()
    cfg = cal.config
    start = time.perf_counter()
    strategy = probe_strategy(cal.fingerprint, cal.num_layers, layer, fraction, patterns, cfg.baseline,
                              cfg.budget if cfg.baseline else 1.0, modality=shares)
    kls, coss, kept = [], [], []
    for w in cal.windows:
        cache = probe_cache(cal.model, strategy, cfg.evict_every, cfg.seed, cal.gates)
        logps, hidden = feed(cal.model, cache, w.ids, w.context, w.inputs)
        kls.append(float(F.kl_div(logps, w.ref_logps, log_target=True, reduction="none").sum(-1).mean()))
        coss.append(float(F.cosine_similarity(hidden, w.ref_hidden, dim=-1).mean()))
        counts = cache.layers[layer].store.modality_counts().double()
        kept.append(counts / counts.sum())
    cal.seconds += time.perf_counter() - start
    split = torch.stack(kept).mean(0)
    return {"kl": sum(kls) / len(kls), "cos": sum(coss) / len(coss),
            "kept": {m: float(split[i]) for i, m in enumerate(MODALITIES)}}


def probes_per_layer(present: list[str]) -> int:
    """Progress-bar steps per layer: free, start, one per modality."""
    return 2 + len(present)


def calibrate_modalities(cal, chosen: dict[str, list[str]], budgets: list[float], bar) -> list[tuple[dict, dict]]:
    """Per layer: (modality shares, the signals that chose them); see the module docstring."""
    cfg = cal.config
    present = cal.modalities
    factor, L = cfg.modality_factor, cal.num_layers
    out = []
    for layer in range(L):
        first, then = chosen["prefill"][layer], chosen["decode"][layer]
        patterns = {"prefill": first} if first == then else {"prefill": first, "decode": then}
        fraction = min(1.0, budgets[layer] * L)
        head = f"modality|{layer}|{'>'.join(patterns.values())}|{fraction:.6g}"

        def probe(shares, layer=layer, patterns=patterns, fraction=fraction):
            return lambda: measure_modality_probe(cal, layer, patterns, fraction, shares)

        free = cal._get_measured(f"{head}|free", probe(None), bar)
        start = start_shares(free["kept"], present)
        base = cal._get_measured(f"{head}|start", probe(start), bar)
        kl_less, sensitivity = {}, {}
        for m in present:
            if start[m] <= 0.0:  # the pattern keeps none of it: nothing to take away
                sensitivity[m] = 0.0
                bar.update(1)
                continue
            less = less_shares(start, m, factor)
            kl_less[m] = cal._get_measured(f"{head}|less:{m}x{factor:g}", probe(less), bar)["kl"]
            sensitivity[m] = max(0.0, kl_less[m] - base["kl"]) / (start[m] * (1.0 - factor))
        shares = modality_shares(start, sensitivity, cfg.modality_floor)
        signals = {"kept_free": {m: free["kept"][m] for m in present}, "kl_free": free["kl"],
                   "start": start, "kl_start": base["kl"], f"kl_share_x{factor:g}": kl_less,
                   "sensitivity": sensitivity, "kept_fraction": fraction}
        out.append((shares, signals))
    return out
