"""``vlm-kv train-vlm``: train smollava's vision tower and projector; SmolLM2 stays frozen
(optionally with low-rank adapters on its attention, ``lora_rank``, trained alongside).

Two stages, one loop each (nanoGPT-style; the data of a step is a function of the step, so a
resumed run sees exactly the data it would have seen):

1. **patch** (``patch_steps``): no pass through the language model. Each visual token is pulled
   toward SmolLM2's own input embedding of the text its cell stands for
   (``Scene.cell_tokens``: a code character, an object's colour / shape / halves, a blank):
   a contrastive loss over the task vocabulary plus sampled negatives, and a squared error
   that keeps the token at an embedding's scale. Why: a tower trained end to end through the
   frozen LM from scratch stays at chance for hundreds of steps (measured, DEVELOPERS.md),
   while this signal reaches ~98% per patch in minutes.
2. **qa** (``qa_steps``): answers through the frozen LM. The loss is the LM's cross-entropy on the
   answer tokens (and ``<|im_end|>``) of single-image items, and every ``multi_every``-th step
   of one multi-image context with several teacher-forced questions; the patch loss stays on
   at ``patch_weight`` so the tokens stay readable as text.

Every ``save_every`` steps a checkpoint (trainable weights, optimizer, stage, step) goes to
``OUT/checkpoint.pt`` (written atomically); ``metrics.jsonl`` gets a line per step and one per
evaluation (held-out data seed ``eval_seed``, greedy answers, exact match). The end writes the
trained parts to ``OUT/final/`` with ``card.json``, and the end of the patch stage writes them to
``OUT/stage1/``. Rerunning the same command resumes; ``stage1_weights`` starts a new folder at
the QA stage from a ``stage1/`` folder (exactly where the uninterrupted run would be).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm.auto import tqdm

from vlm_kv.arguments.dataclass_flags import setting
from vlm_kv.eval.visual_qa import IGNORE, conversation_pieces, encode_pieces, evaluate
from vlm_kv.eval.visual_tasks import (
    BLANK,
    CODE_CHARS,
    COLOURS,
    KINDS,
    LABEL_STYLES,
    SHAPES,
    TRAIN_SEED,
    Item,
    draw_scene,
    make_item,
)
from vlm_kv.models.lora import LoRADelta, LoRASpec, attach_lora, grow_lora, load_lora_state, lora_state
from vlm_kv.models.smollava import (
    IMAGE_TOKEN_ID,
    IMAGE_TOKENS,
    LORA_FILE,
    WEIGHTS_FILE,
    build_smollava,
    load_trained_parts,
    pixel_values,
    read_lora,
    save_lora,
    save_trained_parts,
)
from vlm_kv.train.image_attention import SegmentAttention, image_targets

CHECKPOINT = "checkpoint.pt"
STAGE1 = "stage1"  # trained parts at the end of the patch stage
METRICS = "metrics.jsonl"


@dataclass
class VLMTrainConfig:
    """Every setting of ``vlm-kv train-vlm`` (the CLI flags are generated from these fields)."""

    out: str = setting("runs/smollava", "folder for checkpoint.pt, metrics.jsonl and final/")
    patch_steps: int = setting(400, "stage-1 steps: per-patch loss, no pass through the LM")
    patch_batch: int = setting(32, "images per stage-1 step")
    patch_lr: float = setting(2e-3, "stage-1 peak learning rate")
    qa_steps: int = setting(1500, "stage-2 steps: answers through the frozen LM")
    qa_batch: int = setting(8, "single-image items per stage-2 step")
    qa_lr: float = setting(5e-4, "stage-2 peak learning rate")
    multi_every: int = setting(4, "every Nth stage-2 step is one multi-image context instead")
    multi_images: str = setting("4,10", "LO,HI images in those contexts")
    multi_questions: int = setting(3, "teacher-forced questions in a multi-image context")
    multi_kinds: str = setting("", "question kinds drawn in multi-image contexts, comma-separated; a kind named twice "
                               "is drawn twice as often (empty: every kind alike)")
    image_labels: str = setting("open", "how multi-image contexts label their images: open ('Image k: caption.' "
                                "before each) or bracketed (also 'End of image k.' after each); evaluations use it too")
    patch_weight: float = setting(0.5, "weight of the stage-1 loss kept during stage 2")
    pos_lr_mult: float = setting(30.0, "learning-rate multiplier of the tower's position embeddings")
    negatives: int = setting(512, "sampled vocabulary rows in the contrastive patch loss")
    warmup: int = setting(30, "warmup steps at the start of each stage")
    lm_dtype: str = setting("bfloat16", "the frozen LM's dtype while training: bfloat16 or float32")
    save_every: int = setting(25, "checkpoint every N steps")
    eval_every: int = setting(100, "stage-2 steps between held-out evaluations (0: only at the end)")
    eval_items: int = setting(24, "single-image items per evaluation")
    eval_seed: int = setting(1, "held-out data seed of those evaluations (training uses seed 0)")
    eval_multi_items: int = setting(16, "8-image contexts (one question each) per evaluation (0: none)")
    lora_rank: int = setting(0, "rank of low-rank adapters on the LM's attention projections, trained with the "
                             "tower (0: the LM stays exactly SmolLM2)")
    lora_alpha: float = setting(16.0, "adapter scale numerator (the update is alpha / rank * B A)")
    lora_targets: str = setting("q_proj,k_proj,v_proj,o_proj", "comma-separated LM linear layers that get adapters")
    lora_grow: bool = setting(False, "with --stage1-weights whose adapters are smaller (lower rank, fewer targets): "
                              "start this run's adapters from them, same model at the first step")
    lora_lr_mult: float = setting(5.0, "the adapters' learning rate as a multiple of the stage's rate")
    attention_weight: float = setting(0.0, "weight of the image-attention loss on multi-image steps: -log of the share of "
                                      "the image attention (heads pooled) that the token before each answer gives the "
                                      "asked image, in --attention-layers (0: off)")
    attention_layers: str = setting("20,21,22,23,24", "LM layers of that loss (comma-separated; where the shipped "
                                    "model's question tokens find the asked image most, docs/smollava.md)")
    threads: int = setting(0, "torch threads (0: torch's default)")
    stop_at: int = setting(0, "stop after this many steps in all, checkpointed (0: run to the end)")
    stage1_weights: str = setting("", "start at the QA stage from these trained parts: a stage1/ folder, or a folder "
                                  "written by --export, whose card names the step to continue from (fresh optimizer)")
    export: str = setting("", "write the checkpoint's trained parts and a model card to this folder, then stop")
    progress: bool = setting(True, "show a progress bar")

    def validate(self) -> None:
        for name in ("patch_steps", "qa_steps", "save_every", "eval_every", "threads", "stop_at", "negatives",
                     "eval_multi_items", "lora_rank"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("patch_batch", "qa_batch", "multi_every", "multi_questions", "eval_items"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        lo, hi = self.multi_range
        if not 1 <= lo <= hi:
            raise ValueError(f"multi_images must be LO,HI with 1 <= LO <= HI, got {self.multi_images!r}")
        if self.multi_questions > lo:
            raise ValueError(f"multi_questions ({self.multi_questions}) must be <= the fewest images ({lo})")
        unknown = set(self.multi_kind_list) - set(KINDS)
        if unknown:
            raise ValueError(f"multi_kinds names unknown question kinds {sorted(unknown)}; known: {KINDS}")
        if self.image_labels not in LABEL_STYLES:
            raise ValueError(f"image_labels must be one of {LABEL_STYLES}, got {self.image_labels!r}")
        if self.lm_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"lm_dtype must be bfloat16 or float32, got {self.lm_dtype!r}")
        if self.lora_rank:
            self.lora_spec  # noqa: B018 -- builds (and so checks) the spec
            if self.lora_alpha <= 0 or self.lora_lr_mult <= 0:
                raise ValueError("lora_alpha and lora_lr_mult must be > 0")
        if self.attention_weight < 0:
            raise ValueError(f"attention_weight must be >= 0, got {self.attention_weight}")
        if self.attention_weight:
            self.attention_layer_list  # noqa: B018 -- parses (and so checks) the layers
        if self.lora_grow and not (self.lora_rank and self.stage1_weights):
            raise ValueError("lora_grow starts larger adapters from --stage1-weights: it needs both --lora-rank "
                             "and --stage1-weights")

    @property
    def lora_spec(self) -> LoRASpec | None:
        if not self.lora_rank:
            return None
        targets = tuple(t.strip() for t in self.lora_targets.split(",") if t.strip())
        return LoRASpec(rank=self.lora_rank, alpha=self.lora_alpha, targets=targets)

    @property
    def multi_kind_list(self) -> tuple[str, ...]:
        """The kinds multi-image questions are drawn from, repeats kept (they weight the draw)."""
        kinds = tuple(k.strip() for k in self.multi_kinds.split(",") if k.strip())
        return kinds or KINDS

    @property
    def attention_layer_list(self) -> list[int]:
        try:
            layers = [int(v) for v in self.attention_layers.split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"attention_layers must be comma-separated layer numbers, got {self.attention_layers!r}") from None
        if not layers:
            raise ValueError("attention_layers names no layer")
        return layers

    @property
    def multi_range(self) -> tuple[int, int]:
        try:
            lo, hi = (int(v) for v in self.multi_images.split(","))
        except ValueError:
            raise ValueError(f"multi_images must be LO,HI such as 4,10, got {self.multi_images!r}") from None
        return lo, hi

    @property
    def total_steps(self) -> int:
        return self.patch_steps + self.qa_steps


# ---- sequences -------------------------------------------------------------------------------

def _batch(tokenizer, items: list[Item], turns: int | None = None):
    rows = [encode_pieces(tokenizer, conversation_pieces(it, [q.answer for q in it.questions], turns)) for it in items]
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, (ids, lab) in enumerate(rows):  # right padding: training only, no generation
        input_ids[r, : len(ids)] = torch.tensor(ids)
        labels[r, : len(lab)] = torch.tensor(lab)
        mask[r, : len(ids)] = 1
    images = [im for it in items for im in it.images]
    return input_ids, mask, labels, images


# ---- the two losses ----------------------------------------------------------------------------

class PatchTargets:
    """Token ids of every text a cell may stand for, and the frozen embedding table."""

    def __init__(self, tokenizer, embeddings: torch.Tensor):
        texts = [BLANK, *CODE_CHARS] + [" " + w for w in (*COLOURS, *SHAPES, "left", "right", "above", "below")]
        ids = []
        for t in texts:
            tok = tokenizer.encode(t, add_special_tokens=False)
            if len(tok) != 1:
                raise ValueError(f"cell text {t!r} is {len(tok)} tokens in this tokenizer; each must be one")
            ids.append(tok[0])
        self.id_of = dict(zip(texts, ids))
        self.blank_id = self.id_of[BLANK]
        self.where_ids = torch.tensor([self.id_of[" " + w] for w in ("left", "right", "above", "below")])
        self.task_ids = torch.tensor(ids)
        self.embeddings = embeddings.detach().float()

    def of_scenes(self, scenes) -> torch.Tensor:
        return torch.tensor([[self.id_of[t] for row in s.cell_tokens for t in row] for s in scenes])


def visual_tokens(model, pixels: torch.Tensor) -> torch.Tensor:
    """(images, 196, hidden): what the model puts in place of the image tokens (tested equal to
    ``get_image_features``)."""
    inner = model.model
    hidden = inner.vision_tower(pixels, output_hidden_states=True).hidden_states[model.config.vision_feature_layer]
    return inner.multi_modal_projector(hidden)


def patch_loss(tokens: torch.Tensor, target_ids: torch.Tensor, targets: PatchTargets,
               generator: torch.Generator, negatives: int) -> tuple[torch.Tensor, dict]:
    """Contrastive (cosine / 0.07 over task tokens + sampled vocabulary) + scaled squared error;
    non-blank cells weigh 4x (they are few and carry every answer)."""
    flat = tokens.reshape(-1, tokens.shape[-1]).float()
    tgt = target_ids.reshape(-1)
    vocab = targets.embeddings.shape[0]
    sampled = torch.randint(0, vocab, (negatives,), generator=generator)
    cand = torch.unique(torch.cat([targets.task_ids, sampled]))
    cand_emb = F.normalize(targets.embeddings[cand], dim=-1)
    logits = F.normalize(flat, dim=-1) @ cand_emb.T / 0.07
    index = torch.searchsorted(cand, tgt)
    weight = torch.where(tgt == targets.blank_id, 1.0, 4.0)
    ce = (F.cross_entropy(logits, index, reduction="none") * weight).sum() / weight.sum()
    goal = targets.embeddings[tgt]
    mse = (((flat - goal) ** 2).mean(-1) * weight).sum() / weight.sum() / goal.pow(2).mean()
    with torch.no_grad():
        hit = logits.argmax(-1) == index
        content = tgt != targets.blank_id
        where = torch.isin(tgt, targets.where_ids)  # the words that need the cell's position
        stats = {"patch_acc": hit[content].float().mean().item(), "blank_acc": hit[~content].float().mean().item(),
                 "where_acc": hit[where].float().mean().item() if where.any() else None}
    return ce + mse, stats


# ---- evaluation ---------------------------------------------------------------------------------

# ---- the loop -----------------------------------------------------------------------------------

def attention_loss(looks: SegmentAttention, batch: list[Item], input_ids: torch.Tensor,
                   labels: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(loss, mean share): -log of the share of image attention, heads pooled, that the token before
    each answer gives the image its question asks about, averaged over questions and ``looks``' layers.
    Reads the inputs ``looks`` recorded in the forward just run."""
    losses, shares = [], []
    for row, item in enumerate(batch):
        asked = [q.image_index for q in item.questions]
        found = image_targets(input_ids[row], labels[row], asked, IMAGE_TOKEN_ID, IMAGE_TOKENS, IGNORE)
        for layer in looks.layers:
            mass = looks.mass(layer, row, found).sum(1)  # [Q, S]: heads pooled
            share = mass[torch.arange(len(asked)), found.segments] / mass.sum(-1).clamp_min(1e-12)
            losses.append(-share.clamp_min(1e-12).log())
            shares.append(share.detach())
    return torch.cat(losses).mean(), torch.cat(shares).mean().item()


def _lr(cfg: VLMTrainConfig, stage: str, step: int) -> float:
    steps, peak = (cfg.patch_steps, cfg.patch_lr) if stage == "patch" else (cfg.qa_steps, cfg.qa_lr)
    if step < cfg.warmup:
        return peak * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, steps - cfg.warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _trainable(model) -> list[torch.nn.Parameter]:
    return list(model.model.vision_tower.parameters()) + list(model.model.multi_modal_projector.parameters())


def _adapter_params(adapters: dict[str, LoRADelta]) -> list[torch.nn.Parameter]:
    return [p for delta in adapters.values() for p in (delta.A, delta.B)]


def _optimizer(cfg: VLMTrainConfig, model, params: list[torch.nn.Parameter],
               adapters: dict[str, LoRADelta] | None = None) -> torch.optim.Optimizer:
    """AdamW with the position embeddings in a group of their own at ``pos_lr_mult`` x the rate,
    and the LM's adapters (when trained) in a third at ``lora_lr_mult`` x.

    Why: a fresh tower's position embeddings have norm ~1 against ~7 for the patch embeddings;
    at one learning rate the words that depend on where an object is (its halves) stayed at
    chance for 300 stage-1 steps while every other word reached 100%; at 30x they rose to 71%
    within 40 steps (docs/smollava.md)."""
    pos = model.model.vision_tower.embeddings.position_embedding.weight
    lora = _adapter_params(adapters or {})
    lora_ids = {id(p) for p in lora}
    rest = [p for p in params if p is not pos and id(p) not in lora_ids]
    groups = [{"params": rest, "mult": 1.0}, {"params": [pos], "mult": cfg.pos_lr_mult}]
    if lora:
        groups.append({"params": lora, "mult": cfg.lora_lr_mult})
    return torch.optim.AdamW(groups, lr=cfg.patch_lr, betas=(0.9, 0.98), weight_decay=0.01)


def _scenes(step: int, count: int):
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([TRAIN_SEED, 100, step])))
    return [draw_scene(rng) for _ in range(count)]


def _qa_items(cfg: VLMTrainConfig, step: int) -> tuple[list[Item], str]:
    if step % cfg.multi_every == cfg.multi_every - 1:
        lo, hi = cfg.multi_range
        rng = np.random.default_rng([TRAIN_SEED, 200, step])
        n = int(rng.integers(lo, hi + 1))
        return [make_item("multi_turn", TRAIN_SEED, step, n_images=n, n_questions=cfg.multi_questions,
                          labels=cfg.image_labels, kinds=cfg.multi_kind_list)], "multi"
    return [make_item("single", TRAIN_SEED, step * cfg.qa_batch + j) for j in range(cfg.qa_batch)], "single"


def _save(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # never a half-written checkpoint


def train_vlm(cfg: VLMTrainConfig, model=None, processor=None) -> dict:
    """Run (or resume) both stages; returns the last evaluation. ``model`` / ``processor``: a
    smollava built elsewhere (tests pass one), else ``build_smollava`` with SmolLM2."""
    cfg.validate()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    lm_dtype = getattr(torch, cfg.lm_dtype)
    if model is None:
        model, processor = build_smollava(dtype=lm_dtype)
    tokenizer = processor.tokenizer
    for p in model.parameters():
        p.requires_grad_(False)
    params = _trainable(model)
    for p in params:
        p.data = p.data.float()
        p.requires_grad_(True)
    targets = PatchTargets(tokenizer, model.get_input_embeddings().weight)
    spec = cfg.lora_spec
    # adapters on the frozen LM (float32 parameters; the product is added to the bf16 weights)
    adapters = attach_lora(model.model.language_model, spec) if spec else {}
    params = params + _adapter_params(adapters)
    opt = _optimizer(cfg, model, params, adapters)
    looks = SegmentAttention(model.model.language_model, cfg.attention_layer_list) if cfg.attention_weight else None

    done, stage_of = 0, "patch"
    rewarm_from = -1  # the step a fresh optimizer took over mid-schedule (warmed up again from there)
    ckpt_path = out / CHECKPOINT
    if ckpt_path.is_file():
        state = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        model.load_state_dict(state["trainable"], strict=False)
        for p in params:
            p.data = p.data.float()
        _restore_adapters(adapters, state.get("lora") or None, state.get("lora_spec"), spec, ckpt_path)
        opt = _optimizer(cfg, model, params, adapters)
        opt.load_state_dict(state["optimizer"])
        done = state["done"]
        rewarm_from = int(state.get("rewarm_from", -1))
        _truncate_metrics(out / METRICS, done)
    elif cfg.stage1_weights:
        # the QA stage's data is a function of the step, so trained parts and the step they were
        # saved at are all a run needs to continue (with a fresh optimizer: Adam's moments do not
        # travel, which costs a few steps of warm-up, see docs/smollava.md)
        load_trained_parts(model, cfg.stage1_weights, with_lora=False)
        saved = read_lora(cfg.stage1_weights)
        if saved is not None:
            if cfg.lora_grow and spec is not None:
                grow_lora(adapters, spec, *saved)
            else:
                _restore_adapters(adapters, saved[0], saved[1].to_dict(), spec, Path(cfg.stage1_weights))
        done = max(cfg.patch_steps, int(_card(cfg.stage1_weights).get("done", 0)))
        if done > cfg.patch_steps:
            rewarm_from = done
        _truncate_metrics(out / METRICS, done)
    (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2) + "\n", encoding="utf-8")
    end = cfg.total_steps if not cfg.stop_at else min(cfg.total_steps, cfg.stop_at)
    bar = None
    if cfg.progress:
        bar = tqdm(total=cfg.total_steps, initial=done, desc="train-vlm", dynamic_ncols=True)
    last_eval: dict = {}
    model.train()
    with open(out / METRICS, "a", encoding="utf-8") as metrics:
        while done < end:
            stage_of = "patch" if done < cfg.patch_steps else "qa"
            step = done if stage_of == "patch" else done - cfg.patch_steps
            if stage_of == "qa" and step == 0:  # stage 2 starts with a fresh optimizer
                opt = _optimizer(cfg, model, params, adapters)
            rate = _lr(cfg, stage_of, step)
            if rewarm_from >= 0 and cfg.warmup:
                # a fresh Adam's first updates are lr * sign(grad); ramp again rather than jump
                # to the mid-schedule rate with a trained tower
                rate *= min(1.0, (done - rewarm_from + 1) / cfg.warmup)
            for group in opt.param_groups:
                group["lr"] = rate * group["mult"]
            t0 = time.time()
            gen = torch.Generator().manual_seed(done)
            if stage_of == "patch":
                scenes = _scenes(step, cfg.patch_batch)
                tokens = visual_tokens(model, pixel_values([s.image for s in scenes]))
                loss, stats = patch_loss(tokens, targets.of_scenes(scenes), targets, gen, cfg.negatives)
            else:
                batch, kind = _qa_items(cfg, step)
                input_ids, mask, labels, images = _batch(tokenizer, batch)
                pixels = pixel_values(images)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=lm_dtype == torch.bfloat16):
                    outputs = model(input_ids=input_ids, attention_mask=mask, pixel_values=pixels, labels=labels)
                    attn = attention_loss(looks, batch, input_ids, labels) if looks and kind == "multi" else None
                qa = outputs.loss.float()
                scenes = [s for it in batch for s in it.scenes]
                tokens = visual_tokens(model, pixels)
                ploss, stats = patch_loss(tokens, targets.of_scenes(scenes), targets, gen, cfg.negatives)
                loss = qa + cfg.patch_weight * ploss
                if attn is not None:
                    loss = loss + cfg.attention_weight * attn[0]
                    stats.update({"attention_loss": attn[0].item(), "asked_share": attn[1]})
                stats.update({"qa_loss": qa.item(), "kind": kind, "tokens": int(input_ids.numel())})
            opt.zero_grad(set_to_none=True)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            done += 1
            record = {"step": done, "stage": stage_of, "loss": loss.item(), "lr": opt.param_groups[0]["lr"],
                      "grad_norm": float(norm), "seconds": round(time.time() - t0, 3), **stats}
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            if bar is not None:
                bar.set_postfix(stage=stage_of, loss=f"{loss.item():.3f}", acc=f"{stats['patch_acc']:.2f}")
                bar.update(1)
            eval_now = (stage_of == "qa" and cfg.eval_every and (step + 1) % cfg.eval_every == 0) or done == cfg.total_steps
            if eval_now:
                model.eval()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=lm_dtype == torch.bfloat16):
                    last_eval = {"single": evaluate(model, tokenizer, "single", cfg.eval_seed, cfg.eval_items)}
                    if cfg.eval_multi_items:
                        last_eval["multi_image"] = evaluate(model, tokenizer, "multi_image", cfg.eval_seed,
                                                            cfg.eval_multi_items, n_images=8,
                                                            labels=cfg.image_labels)
                model.train()
                for result in last_eval.values():
                    metrics.write(json.dumps({"step": done, "eval": result}) + "\n")
                metrics.flush()
            if done == cfg.patch_steps:
                save_trained_parts(model, out / STAGE1)
            if done % cfg.save_every == 0 or done == end:
                _save(ckpt_path, {"trainable": {k: v for k, v in model.state_dict().items()
                                                if k.startswith(("model.vision_tower.", "model.multi_modal_projector."))},
                                  "lora": lora_state(adapters), "lora_spec": spec.to_dict() if spec else None,
                                  "optimizer": opt.state_dict(), "done": done, "stage": stage_of,
                                  "rewarm_from": rewarm_from,
                                  "config": dataclasses.asdict(cfg)})
    if bar is not None:
        bar.close()
    if looks is not None:
        looks.close()
    model.eval()
    if done == cfg.total_steps:
        card = {"model": "smollava", "steps": {"patch": cfg.patch_steps, "qa": cfg.qa_steps},
                "train_data_seed": TRAIN_SEED, "config": dataclasses.asdict(cfg), "last_eval": last_eval,
                "lora": spec.to_dict() if spec else None}
        save_trained_parts(model, out / "final", card)
        if spec:
            save_lora(out / "final", lora_state(adapters), spec)
    return last_eval


def _restore_adapters(adapters: dict[str, LoRADelta], state: dict | None, saved_spec: dict | None,
                      spec: LoRASpec | None, source: Path) -> None:
    """Load saved adapters into the attached ones; the saved and configured specs must agree
    (a run without adapters cannot silently continue one that had them, nor the reverse, except
    that adapters may start fresh from a tower that never had any)."""
    if state is None:
        if spec is not None and source.name == CHECKPOINT:
            raise ValueError(f"{source} was trained without LoRA adapters; resume it without --lora-rank, "
                             "or start a new --out from an export (--stage1-weights)")
        return
    if spec is None:
        raise ValueError(f"{source} holds LoRA adapters on the LM; pass the same --lora-rank / --lora-alpha / "
                         "--lora-targets to continue it")
    if LoRASpec.from_dict(saved_spec) != spec:
        raise ValueError(f"{source}: its LoRA spec {saved_spec} differs from this run's {spec.to_dict()}")
    load_lora_state(adapters, state)


def _card(folder: str | os.PathLike) -> dict:
    path = Path(folder) / "card.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def export_checkpoint(run: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """The trained parts of ``run``'s latest checkpoint as ``dest/vision.safetensors`` plus a
    model card (steps done, data seeds, wall time, the held-out evaluations so far), so a run can
    ship its weights or continue in another session (``--stage1-weights dest``)."""
    run = Path(run)
    ckpt = run / CHECKPOINT
    if not ckpt.is_file():
        raise FileNotFoundError(f"{ckpt}: no checkpoint to export (run `vlm-kv train-vlm --out {run}` first)")
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    done = int(state["done"])
    metrics = []
    if (run / METRICS).is_file():
        metrics = [json.loads(line) for line in (run / METRICS).read_text(encoding="utf-8").splitlines() if line.strip()]
    metrics = [m for m in metrics if m.get("step", 0) <= done]
    evals = [{"step": m["step"], **m["eval"]} for m in metrics if "eval" in m]
    seconds = sum(m.get("seconds", 0.0) for m in metrics if "seconds" in m)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.float32).contiguous() for k, v in state["trainable"].items()}
    save_file(tensors, str(dest / WEIGHTS_FILE), metadata={"model": "smollava"})
    if (dest / LORA_FILE).is_file() and not state.get("lora"):
        (dest / LORA_FILE).unlink()  # an older export's adapters must not be merged into this tower
    card = {"model": "smollava", "done": done, "stage": state["stage"], "train_data_seed": TRAIN_SEED,
            "held_out_eval_seed": state["config"]["eval_seed"],
            "steps_logged_seconds": round(seconds, 1), "evaluations": evals, "config": state["config"],
            "lora": state.get("lora_spec")}
    if state.get("lora"):
        save_lora(dest, state["lora"], LoRASpec.from_dict(state["lora_spec"]))
    (dest / "card.json").write_text(json.dumps(card, indent=2) + "\n", encoding="utf-8")
    return dest / WEIGHTS_FILE


def _truncate_metrics(path: Path, done: int) -> None:
    """Drop metric lines past the checkpoint (a resumed run writes them again)."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= done]
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
