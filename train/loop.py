"""The gate training loop: a frozen model, trainable retention gates, one readable loop.

    loss = (KL(p_full || q_gated) + CE) / 2 + lambda_cap * L_cap        (see losses.py)

Per optimizer step: ``grad_accum`` micro-batches of ``batch_size`` sequences; each runs the
frozen model twice, once plain (teacher, no grad) and once under ``SoftRetention`` (student:
attention logits get ``(t - i) * log beta_i``), and backpropagates into the gates only.

Multi-GPU: built on ``accelerate``; the gates (wrapped with the frozen model in
``GatedStudent`` so data parallel sees one forward) and the optimizer are prepared, the
frozen model is moved to ``accelerator.device``, each process reads its own slice of the
data stream. ``accelerate launch -m vlm_kv.train.cli ...`` works unchanged. bf16 autocast
on GPU only; CPU runs in float32.

Hyperparameter defaults (documented choices):
* lr 1e-3 (the reference uses 2e-4 for 10k-step GPU runs; gates start at logit 18 and Adam
  moves a weight about lr per step, so the short CPU runs this project can afford on
  ~100M-parameter models need the larger rate to leave the keep-everything start),
  weight decay 1e-6 (reference), betas (0.9, 0.95), grad-norm clip 1.0;
* warmup min(100, steps // 10) steps, then cosine decay to min_lr = lr / 10.

Budget: either a fixed ``budget_tokens`` M per KV head, or ``budget_range = (lo, hi)``: each
optimizer step draws one fraction f from [lo, hi] (log-uniform, so 0.05-0.1 weighs as much as
0.15-0.3) and every sequence of the step gets M = f * its length. The draw is a function of
(seed, step) only, so a resumed run draws the same sequence. One gate set then serves every
budget in the range (the shipped gates are evaluated at 0.05, 0.1 and 0.25).

``init_gates``: start from saved gates (same shape) instead of the fresh init: fine-tuning,
e.g. the short-sequence gates at the serving length.

Checkpoints (every ``save_every`` steps and at the end) live in ``OUT/checkpoints/step-N.pt``
and hold the gates, optimizer, scheduler, RNG states, data position and step; ``resume``
continues from the latest one and reproduces the same next step exactly. The final gates
go to ``OUT`` via ``gates.io.save_gates`` with ``GateConfig.training`` filled in; one JSON
line per step goes to ``OUT/metrics.jsonl``.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from accelerate import Accelerator
from tqdm.auto import tqdm
from vlm_kv.eval.planted_facts import FACT_KINDS
from vlm_kv.gates.io import load_gates, save_gates
from vlm_kv.gates.retention_gate import GateConfig, RetentionGates
from vlm_kv.train.data import FactsMix, TrainingData
from vlm_kv.train.losses import budget_from_fraction, capacity_loss, distill_losses
from vlm_kv.train.soft_retention import SoftRetention
from vlm_kv.train.teacher import ranking_loss, reconstruction_kept

from vlm_kv.api import attach
from vlm_kv.models.named import load_model_and_processor

CKPT_DIR = "checkpoints"
METRICS = "metrics.jsonl"


@dataclass
class TrainConfig:
    data: list[str]
    out: str
    model: Any = "smollm2"          # "smollm2", a local folder, or an nn.Module (then pass processor)
    processor: Any = None           # tokenizer / processor for an nn.Module model
    budget_tokens: int | None = None  # M, tokens per KV head (fixed); or give budget_range
    budget_range: tuple[float, float] | None = None  # fractions of each sequence, drawn per step
    global_budget: bool = False     # DBTrimKV global capacity loss (else per head)
    max_length: int = 512
    steps: int = 100
    batch_size: int = 1
    grad_accum: int = 1
    lr: float = 1e-3
    min_lr: float | None = None     # default lr / 10
    warmup: int | None = None       # default min(100, steps // 10)
    weight_decay: float = 1e-6
    grad_clip: float = 1.0
    lambda_cap: float = 1.0
    kind: str = "dbtrimkv"
    coupled: bool = True
    width: int = 64
    init_bias: float = 18.0
    seed: int = 0
    init_gates: str | None = None   # folder of saved gates to start from
    exact_capacity: bool = False    # O(T^2) double sum for S_t instead of the O(T) scan
    save_every: int = 100
    keep_checkpoints: int = 2
    resume: bool = False
    stop_at: int | None = None      # stop after this step (leaving a checkpoint); schedule still spans `steps`
    progress: bool = True
    facts_share: float = 0.0        # share of text samples turned into planted-fact chats (train/data.py)
    facts_per_sample: int = 3
    facts_kinds: tuple[str, ...] = FACT_KINDS  # which kinds are planted (hold one out to test transfer)
    # weight of the distillation loss averaged over answer tokens only, added to the loss over all
    # tokens: answers are ~2% of a facts chat, so in the plain average a dropped fact barely counts.
    # The answers: those of the planted-fact chats, and the assistant turns of conversation data
    # (e.g. questions about images asked after them, vlm_kv.eval.visual_export)
    answer_weight: float = 0.0
    # weight of the reconstruction teacher (train/teacher.py): the gates' end-of-sample ranking held
    # against the entries KVzip keeps at the step's budget; 0 = off. Text samples only.
    teacher_weight: float = 0.0
    teacher_temperature: float = 1.0
    teacher_per_layer: bool = False  # rank KVzip's set within each layer (the split between layers left to the gates)
    extra: dict = field(default_factory=dict)


class GatedStudent(nn.Module):
    """The gates plus a reference to the frozen model (not a registered submodule, so data
    parallel only syncs the gates). forward -> (logits, per-layer log betas)."""

    def __init__(self, model: nn.Module, gates: RetentionGates) -> None:
        super().__init__()
        self.gates = gates
        object.__setattr__(self, "frozen", model)

    def forward(self, inputs: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
        with SoftRetention(self.frozen, self.gates) as soft:
            logits = self.frozen(**inputs, use_cache=False).logits
        return logits, soft.log_betas


def resolved_warmup(cfg: TrainConfig) -> int:
    return cfg.warmup if cfg.warmup is not None else min(100, cfg.steps // 10)


def resolved_min_lr(cfg: TrainConfig) -> float:
    return cfg.min_lr if cfg.min_lr is not None else cfg.lr / 10


def check_data(cfg: TrainConfig) -> None:
    """Every training file exists and holds something: checked before the model loads."""
    FactsMix(cfg.facts_share, cfg.facts_per_sample, tuple(cfg.facts_kinds))  # range checks
    conversations = any(str(p).endswith((".jsonl", ".json")) for p in cfg.data)
    if cfg.answer_weight < 0 or (cfg.answer_weight > 0 and cfg.facts_share == 0 and not conversations):
        raise ValueError(f"answer_weight {cfg.answer_weight} needs to be >= 0, and > 0 only with a facts share "
                         "(the answers of the planted-fact chats) or conversation data (.jsonl: the answers "
                         "are its assistant turns)")
    if cfg.teacher_weight < 0 or cfg.teacher_temperature <= 0:
        raise ValueError(f"teacher_weight must be >= 0 and teacher_temperature > 0, got {cfg.teacher_weight} and "
                         f"{cfg.teacher_temperature}")
    for path in cfg.data:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"training data file not found: {path}")
        if os.path.getsize(path) == 0:
            raise ValueError(f"training data file {path} is empty")


def check_budget(cfg: TrainConfig) -> None:
    if cfg.budget_range is None:
        if cfg.budget_tokens is None or cfg.budget_tokens < 1:
            raise ValueError("give budget_tokens >= 1 or a budget_range of fractions")
        return
    if cfg.budget_tokens is not None:
        raise ValueError("give either budget_tokens or budget_range, not both")
    lo, hi = cfg.budget_range
    if not 0 < lo <= hi <= 1:
        raise ValueError(f"budget_range must satisfy 0 < lo <= hi <= 1, got {cfg.budget_range}")


def sampled_budget(cfg: TrainConfig, step: int) -> float | None:
    """The budget fraction of optimizer step ``step`` (0-based); None for a fixed budget_tokens.

    Log-uniform in budget_range, drawn from a generator seeded by (seed, step) alone, so the
    sequence does not depend on what ran before (resume draws the same values)."""
    if cfg.budget_range is None:
        return None
    lo, hi = cfg.budget_range
    if lo == hi:
        return float(lo)
    g = torch.Generator().manual_seed(1_000_003 * (cfg.seed + 1) + step)
    u = torch.rand((), generator=g, dtype=torch.float64).item()
    return math.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Multiplier of cfg.lr at optimizer step ``step`` (0-based): linear warmup, cosine to min_lr."""
    warmup = resolved_warmup(cfg)
    min_ratio = resolved_min_lr(cfg) / cfg.lr
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def latest_checkpoint(out: str) -> str | None:
    paths = sorted(glob.glob(os.path.join(out, CKPT_DIR, "step-*.pt")))
    return paths[-1] if paths else None


def _training_info(cfg: TrainConfig) -> dict:
    """Every hyperparameter of the run, defaults resolved, for GateConfig.training."""
    return {
        "budget_tokens": cfg.budget_tokens,
        "budget_range": list(cfg.budget_range) if cfg.budget_range is not None else None,
        "budget_sampling": "log-uniform per step" if cfg.budget_range is not None else None,
        "global": cfg.global_budget, "data": list(cfg.data),
        "model": cfg.model if isinstance(cfg.model, str) else type(cfg.model).__name__,
        "steps": cfg.steps, "max_length": cfg.max_length, "batch_size": cfg.batch_size,
        "grad_accum": cfg.grad_accum, "lr": cfg.lr, "min_lr": resolved_min_lr(cfg),
        "warmup": resolved_warmup(cfg), "schedule": "linear warmup, cosine to min_lr",
        "optimizer": "AdamW", "betas": [0.9, 0.95], "weight_decay": cfg.weight_decay,
        "grad_clip": cfg.grad_clip, "lambda_cap": cfg.lambda_cap, "seed": cfg.seed,
        "kind": cfg.kind, "coupled": cfg.coupled, "width": cfg.width, "init_bias": cfg.init_bias,
        "init_gates": cfg.init_gates,
        "capacity": "exact O(T^2) double sum" if cfg.exact_capacity else "O(T) rate-grid scan, grid step 0.25",
        "facts_share": cfg.facts_share, "facts_per_sample": cfg.facts_per_sample,
        "facts_kinds": list(cfg.facts_kinds), "answer_weight": cfg.answer_weight,
        "teacher": ({"kind": "kvzip reconstruction kept set at the step's budget", "weight": cfg.teacher_weight,
                     "temperature": cfg.teacher_temperature,
                     "ranked": "within each layer" if cfg.teacher_per_layer else "over all layers"}
                    if cfg.teacher_weight > 0 else None),
    }


def train_gates(config: TrainConfig | dict) -> dict:
    """Train retention gates for a frozen model; returns a summary dict (out, step, last metrics)."""

    cfg = config if isinstance(config, TrainConfig) else TrainConfig(**config)
    check_budget(cfg)
    check_data(cfg)
    use_bf16 = torch.cuda.is_available()
    accelerator = Accelerator(mixed_precision="bf16" if use_bf16 else "no")
    device, rank, world = accelerator.device, accelerator.process_index, accelerator.num_processes

    # ---- frozen model
    if isinstance(cfg.model, nn.Module):
        model, processor = cfg.model, cfg.processor
        if processor is None:
            raise ValueError("pass processor= with an in-memory model")
    else:
        model, processor = load_model_and_processor(cfg.model)
    model.eval().requires_grad_(False).to(device)
    adapter = attach(model)

    # ---- gates (seeded init), optimizer, schedule
    torch.manual_seed(cfg.seed)
    gate_cfg = GateConfig(kind=cfg.kind, hidden_size=adapter.hidden_size, num_layers=adapter.num_layers,
                          num_kv_heads=adapter.num_kv_heads, width=cfg.width, init_bias=cfg.init_bias,
                          coupled=cfg.coupled, model=adapter.fingerprint(), training=_training_info(cfg))
    gates = RetentionGates(gate_cfg)
    if cfg.init_gates:
        # a VLM's gates may start from its language model's (same config hash, another family)
        start_from = load_gates(cfg.init_gates, fingerprint=adapter.fingerprint(), any_family=True)
        if (start_from.config.kind, start_from.config.width, start_from.config.coupled) != (cfg.kind, cfg.width, cfg.coupled):
            raise ValueError(f"init_gates {cfg.init_gates} are {start_from.config.kind} width {start_from.config.width} "
                             f"coupled={start_from.config.coupled}; this run trains {cfg.kind} width {cfg.width} "
                             f"coupled={cfg.coupled}")
        gates.load_state_dict({k: v.float() for k, v in start_from.state_dict().items()})
    gates = gates.to(device)
    student = GatedStudent(model, gates)
    optimizer = torch.optim.AdamW(gates.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, cfg))
    student, optimizer = accelerator.prepare(student, optimizer)

    facts = FactsMix(cfg.facts_share, cfg.facts_per_sample, tuple(cfg.facts_kinds)) if cfg.facts_share > 0 else None
    data = TrainingData(cfg.data, processor, cfg.max_length, seed=cfg.seed,
                        image_token_id=adapter.image_token_id, video_token_id=adapter.video_token_id, facts=facts,
                        answer_turns=cfg.answer_weight > 0)

    # ---- resume
    start = 0
    os.makedirs(cfg.out, exist_ok=True)
    metrics_path = os.path.join(cfg.out, METRICS)
    ckpt = latest_checkpoint(cfg.out) if cfg.resume else None
    if ckpt is not None:
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        accelerator.unwrap_model(student).gates.load_state_dict(state["gates"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        data.load_state_dict(state["data"])
        _set_rng_state(state["rng"])
        start = int(state["step"])
        if accelerator.is_main_process and os.path.exists(metrics_path):  # drop lines past the checkpoint
            with open(metrics_path) as fh:
                lines = [ln for ln in fh if ln.strip() and json.loads(ln)["step"] <= start]
            with open(metrics_path, "w") as fh:
                fh.writelines(lines)
    elif accelerator.is_main_process and os.path.exists(metrics_path):
        os.remove(metrics_path)

    def save_checkpoint(step: int) -> None:
        if not accelerator.is_main_process:
            return
        folder = os.path.join(cfg.out, CKPT_DIR)
        os.makedirs(folder, exist_ok=True)
        state = {
            "step": step,
            "gates": accelerator.unwrap_model(student).gates.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "data": data.state_dict(),
            "rng": _rng_state(),
            "gate_config": gate_cfg.__dict__,
        }
        path = os.path.join(folder, f"step-{step:07d}.pt")
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
        for old in sorted(glob.glob(os.path.join(folder, "step-*.pt")))[: -max(1, cfg.keep_checkpoints)]:
            os.remove(old)

    # ---- loop
    last_step = min(cfg.steps, cfg.stop_at) if cfg.stop_at is not None else cfg.steps
    bar = None
    if cfg.progress and accelerator.is_main_process:
        bar = tqdm(total=cfg.steps, initial=start, desc="train-gates", dynamic_ncols=True)
    metrics: dict = {}
    times: list[float] = []
    gate_params = [p for p in gates.parameters()]
    for step in range(start, last_step):
        t0 = time.perf_counter()
        sums = torch.zeros(8, device=device)  # loss, kl, ce, cap, answer kl, teacher loss, agreement, tokens
        live_sum = None
        fraction = sampled_budget(cfg, step)
        for micro in range(cfg.grad_accum):
            batch = {k: v.to(device) for k, v in data.next_batch(cfg.batch_size, rank, world).items()}
            labels = batch.pop("labels")
            answer_mask = batch.pop("answer_mask", None)
            sync = contextlib.nullcontext() if micro == cfg.grad_accum - 1 else accelerator.no_sync(student)
            with sync, accelerator.autocast():
                with torch.no_grad():
                    teacher = model(**batch, use_cache=False).logits
                logits, log_betas = student(batch)
                kl, ce = distill_losses(logits, teacher, labels)
                valid = batch["attention_mask"].bool()
                budget = cfg.budget_tokens if fraction is None else budget_from_fraction(fraction, valid)
                cap, live = capacity_loss(log_betas, budget, cfg.global_budget, valid=valid,
                                          exact=cfg.exact_capacity)
                loss = 0.5 * (kl + ce) + cfg.lambda_cap * cap
                answer_kl = torch.zeros((), device=device)
                if answer_mask is not None and answer_mask.any():
                    answer_kl, answer_ce = distill_losses(logits, teacher, labels.masked_fill(~answer_mask, -100))
                    loss = loss + cfg.answer_weight * 0.5 * (answer_kl + answer_ce)
                teacher_loss = agreement = torch.zeros((), device=device)
                if cfg.teacher_weight > 0:
                    if "pixel_values" in batch or "pixel_values_videos" in batch:
                        raise ValueError("the reconstruction teacher reads samples back as text; this batch has "
                                         "images or video")
                    f = fraction if fraction is not None else min(1.0, cfg.budget_tokens / batch["input_ids"].shape[1])
                    kept = reconstruction_kept(model, data.tokenizer, batch["input_ids"], batch["attention_mask"], f,
                                               per_layer=cfg.teacher_per_layer)
                    terms = ranking_loss(log_betas, kept, cfg.teacher_temperature, per_layer=cfg.teacher_per_layer)
                    teacher_loss, agreement = terms.loss, terms.agreement
                    loss = loss + cfg.teacher_weight * teacher_loss
                accelerator.backward(loss / cfg.grad_accum)
            sums += torch.stack([loss.detach(), kl.detach(), ce.detach(), cap.detach(), answer_kl.detach(),
                                 teacher_loss.detach(), agreement, batch["attention_mask"].sum().float()])
            live_sum = live if live_sum is None else live_sum + live
        if cfg.grad_clip:
            grad_norm = accelerator.clip_grad_norm_(gate_params, cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        stats = accelerator.reduce(sums / torch.tensor([cfg.grad_accum] * 7 + [1.0], device=device), "mean")
        live_mean = accelerator.reduce(live_sum / cfg.grad_accum, "mean")
        dt = time.perf_counter() - t0
        times.append(dt)
        done = step + 1
        metrics = {
            "step": done, "loss": stats[0].item(), "kl": stats[1].item(), "ce": stats[2].item(),
            "cap": stats[3].item(), "answer_kl": stats[4].item(), "teacher_loss": stats[5].item(),
            "teacher_agreement": stats[6].item(), "live": live_mean.mean().item(), "budget": fraction,
            "live_per_head": [[round(x, 5) for x in row] for row in live_mean.tolist()],
            "lr": scheduler.get_last_lr()[0], "grad_norm": float(grad_norm) if cfg.grad_clip else None,
            "tokens": int(stats[7].item() * world), "sec": round(dt, 4), "data_position": data.position,
        }
        if accelerator.is_main_process:
            with open(metrics_path, "a") as fh:
                fh.write(json.dumps(metrics) + "\n")
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.4f}", kl=f"{metrics['kl']:.4f}", ce=f"{metrics['ce']:.3f}",
                            cap=f"{metrics['cap']:.4f}",
                            live=f"{metrics['live']:.3f}[{live_mean.min().item():.2f}-{live_mean.max().item():.2f}]")
        if done % cfg.save_every == 0 or done == last_step:
            save_checkpoint(done)
        accelerator.wait_for_everyone()
    if bar is not None:
        bar.close()

    final = accelerator.unwrap_model(student).gates
    if last_step >= cfg.steps and accelerator.is_main_process:
        final.config.training = dict(_training_info(cfg), steps_done=last_step)
        save_gates(final, cfg.out)
    accelerator.wait_for_everyone()
    return {
        "out": cfg.out, "step": last_step, "metrics": metrics,
        "seconds_per_step": (sum(times) / len(times)) if times else None, "gates": final,
    }


def export_checkpoint(checkpoint: str, folder: str, dtype: torch.dtype = torch.float32) -> RetentionGates:
    """Write the gates of a training checkpoint as a gate folder (for a run stopped early);
    ``GateConfig.training["steps_done"]`` says how far it got."""
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    config = GateConfig(**state["gate_config"])
    config.training = dict(config.training, steps_done=int(state["step"]))
    gates = RetentionGates(config)
    gates.load_state_dict(state["gates"])
    save_gates(gates, folder, dtype=dtype)
    return gates
