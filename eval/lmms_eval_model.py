"""lmms-eval integration: a local VLM generating on a vlm-kv cache, as lmms-eval model ``vlm_kv``.

Install with ``pip install 'vlm-kv[lmms]'``; the package declares an ``lmms_eval.models`` entry
point, so lmms-eval's own command line finds the model by name::

    python -m lmms_eval --model vlm_kv \
        --model_args pretrained=/models/Qwen2.5-VL-7B-Instruct,policy=snapkv,budget=0.1 \
        --tasks mme --batch_size 1 --output_path logs/

(``python -m vlm_kv.eval.lmms_eval_model ...`` does the same: it registers the class and runs
lmms-eval's command line). A MathVision task that runs offline: ``vlm_kv.eval.lmms_tasks``.
From Python::
    from vlm_kv.eval.lmms_eval_model import lmms_class
    lm = lmms_class()(pretrained="/models/Qwen2.5-VL-7B-Instruct", policy="snapkv", budget=0.1)
    lmms_eval.evaluator.simple_evaluate(model=lm, tasks=["mme"], batch_size=1)

Model arguments: ``pretrained`` (local folder, required), ``policy`` (default ``snapkv``;
``full`` = no compression), ``budget`` (a fraction with a decimal point, 0.1 or 1.0, or an int >= 2,
tokens per KV head, 256; a bare 1 is refused as ambiguous; default 0.25, and none for ``full``),
``gates``, ``strategy`` (polykv), ``tiers`` (int2 / none), every scalar ``CacheOptions`` field
(``evict_every``, ``prefill_chunk``, ``slack``, ``seed``, ``attention_backend``, ``allocation``) and
every ``TierConfig`` field with a command-line flag (``int2_share``, ``int2_value``, ``window``,
``key_rope``, ``spill``, ``fp_unit``, ``key_grid``, ``basis``), all passed to ``vlm_kv.make_cache``;
``device``, ``dtype`` (auto / bfloat16 / float16 / float32),
``max_new_tokens`` (default when a task sets none), ``min_pixels`` / ``max_pixels`` (Qwen VL:
images sized as qwen-vl-utils does, ``vlm_kv.models.vision_inputs``). It is a "simple" lmms-eval model: requests
carry the prompt text and ``doc_to_visual``; images go before the text in one user turn.
``generate_until``: one request at a time, each on a fresh cache. ``generate_until_multi_round``
(multi-turn tasks): every round of a document is prefilled on top of the same compressed cache,
with the model's own earlier answers as history (``vlm_kv.eval.mmdu_run.DialogRunner``).
``loglikelihood`` is not implemented (it raises ``NotImplementedError``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import typing
import warnings
from typing import Any, Mapping

import torch
from PIL import Image
from tqdm.auto import tqdm

from vlm_kv.api import cache_kwarg, check_cache_options, make_cache, tiers_with_fields
from vlm_kv.arguments.tier_flags import tier_flag_fields
from vlm_kv.config import CacheOptions, TierConfig, budget_value
from vlm_kv.eval.mmdu_data import IMAGE_TAG
from vlm_kv.eval.mmdu_run import DialogRunner
from vlm_kv.models.named import load_vlm
from vlm_kv.models.vision_inputs import is_qwen_vl_processor, qwen_vision_info
from vlm_kv.policies import FULL_POLICY, POLICIES

__all__ = [
    "MODEL_NAME",
    "lmms_manifest",
    "INSTALL_HINT",
    "parse_model_args",
    "split_model_args",
    "VLMKVGenerator",
    "lmms_class",
    "main",
]

MODEL_NAME = "vlm_kv"
INSTALL_HINT = "pip install 'vlm-kv[lmms]'"

# cache settings in model arguments: make_cache's own, then CacheOptions' and TierConfig's fields
# (generated from the dataclasses, so a new option is declared once)
_MAKE_CACHE_ARGS = ("policy", "budget", "gates", "strategy", "tiers")
_OPTION_ARGS = tuple(f.name for f in dataclasses.fields(CacheOptions)
                     if typing.get_type_hints(CacheOptions)[f.name] in (int, str, int | None, str | None))
_TIER_ARGS = tuple(f.name for f in tier_flag_fields())
_CACHE_ARGS = _MAKE_CACHE_ARGS + _OPTION_ARGS + _TIER_ARGS
_LOAD_ARGS = ("pretrained", "device", "dtype", "max_new_tokens", "min_pixels", "max_pixels")
# passed by lmms-eval's harness on its own; accepted and ignored (one request at a time)
_HARNESS_ARGS = ("batch_size", "max_batch_size", "trust_remote_code", "use_cache")
DEFAULTS = {"policy": "snapkv", "budget": 0.25, "device": None, "dtype": "auto", "max_new_tokens": 1024}


def _int(name: str):
    def conv(value) -> int:
        if isinstance(value, bool):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be an integer, got {value!r}") from None
        if f != int(f):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        return int(f)

    return conv


def _flag(name: str):
    def conv(value) -> bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name} must be true or false, got {value!r}")

    return conv


def _converter(cls: type, name: str):
    """A model argument's string -> the type of ``cls``'s field ``name``."""
    kind = typing.get_type_hints(cls)[name]
    if kind in (int, int | None):
        return _int(name)
    if kind is bool:
        return _flag(name)
    if kind in (float, float | None):
        return float
    return str


_CONVERT = {
    "budget": budget_value,
    **{name: _converter(CacheOptions, name) for name in _OPTION_ARGS},
    **{name: _converter(TierConfig, name) for name in _TIER_ARGS},
    "max_new_tokens": _int("max_new_tokens"),
    "min_pixels": _int("min_pixels"),
    "max_pixels": _int("max_pixels"),
}


def _make_cache_kwargs(flat: dict[str, Any]) -> dict[str, Any]:
    """Flat model arguments -> ``make_cache`` keywords: ``options=CacheOptions(...)`` and ``tiers=``
    ("int2", "none", or a dict of the TierConfig fields given)."""
    out = {k: v for k, v in flat.items() if k in _MAKE_CACHE_ARGS}
    options = {k: v for k, v in flat.items() if k in _OPTION_ARGS}
    if options:
        out["options"] = CacheOptions(**options)
    tiers = tiers_with_fields(flat["policy"], flat.get("tiers"), {k: v for k, v in flat.items() if k in _TIER_ARGS})
    if tiers is not None:
        out["tiers"] = tiers
    return out


def parse_model_args(text: str) -> dict[str, str]:
    """``"pretrained=PATH,policy=snapkv,budget=0.1"`` -> a dict of strings (lmms-eval's format)."""
    out: dict[str, str] = {}
    for part in str(text or "").split(","):
        part = part.strip()
        if not part:
            continue
        if "=" not in part:
            raise ValueError(f"model argument {part!r} is not key=value")
        key, value = part.split("=", 1)
        out[key.strip()] = value.strip()
    return out


def split_model_args(args: str | Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(load kwargs, ``make_cache`` kwargs) from model arguments (a string or lmms-eval's dict).

    Values may be strings or already typed (lmms-eval converts numbers). The cache settings are
    checked as ``make_cache`` checks them (``vlm_kv.api.check_cache_options``), before any model loads.
    Unknown keys are ignored with a warning.
    """
    raw = parse_model_args(args) if isinstance(args, str) else dict(args)
    load: dict[str, Any] = {k: DEFAULTS[k] for k in ("device", "dtype", "max_new_tokens")}
    cache: dict[str, Any] = {"policy": DEFAULTS["policy"]}
    unknown = []
    for key, value in raw.items():
        if value is None:
            continue
        conv = _CONVERT.get(key, lambda v: v)
        if key in _CACHE_ARGS:
            cache[key] = conv(value)
        elif key in _LOAD_ARGS:
            load[key] = conv(value)
        elif key not in _HARNESS_ARGS:
            unknown.append(key)
    if unknown:
        warnings.warn(f"vlm_kv lmms-eval model: ignoring unknown model argument(s) {', '.join(sorted(unknown))}; "
                      f"known: {', '.join(_LOAD_ARGS + _CACHE_ARGS)}", RuntimeWarning, stacklevel=2)
    if not load.get("pretrained"):
        raise ValueError("vlm_kv lmms-eval model needs pretrained=PATH (a local Qwen2.5-VL or LLaVA folder)")

    policy = str(cache["policy"])
    if policy != FULL_POLICY and policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; known: {', '.join([FULL_POLICY, *POLICIES])}")
    cache["policy"] = policy
    # the full cache takes no budget; the others default to DEFAULTS["budget"]
    cache.setdefault("budget", 1.0 if policy == FULL_POLICY else DEFAULTS["budget"])
    cache = _make_cache_kwargs(cache)
    check_cache_options(**cache)  # a bad budget or option fails here, before the model loads
    return load, cache


# ----------------------------------------------------------------------------- generation




def _as_images(visuals) -> list:
    out = []
    for v in visuals or []:
        if v is None:
            continue
        if isinstance(v, (list, tuple)):
            out.extend(_as_images(v))
        elif isinstance(v, Image.Image):
            out.append(v.convert("RGB"))
        elif isinstance(v, str):
            with Image.open(v) as im:
                out.append(im.convert("RGB"))
        else:
            raise NotImplementedError(f"vlm_kv lmms-eval model handles images only, got {type(v).__name__}")
    return out


class VLMKVGenerator:
    """Greedy (or sampled) generation of one prompt + images on a fresh vlm-kv cache.

    Independent of lmms-eval; the lmms-eval class delegates to it.
    """

    def __init__(self, model, processor, cache_kwargs: Mapping[str, Any], max_new_tokens: int = 1024,
                 min_pixels: int | None = None, max_pixels: int | None = None):
        self.qwen_sizing = is_qwen_vl_processor(processor)  # images sized as qwen-vl-utils does
        if not self.qwen_sizing and (min_pixels is not None or max_pixels is not None):
            raise ValueError(f"min_pixels / max_pixels apply to Qwen VL processors, not {type(processor).__name__}")
        self.pixel_limits = {"min_pixels": min_pixels, "max_pixels": max_pixels}
        self.model = model
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.cache_kwargs = dict(cache_kwargs)
        self.max_new_tokens = int(max_new_tokens)
        self.cache_kw = cache_kwarg(model)
        self.last_kv_bytes: int | None = None

    @classmethod
    def from_pretrained(cls, pretrained: str, cache_kwargs: Mapping[str, Any], *, device: str | None = None,
                        dtype: str = "auto", max_new_tokens: int = 1024, min_pixels: int | None = None,
                        max_pixels: int | None = None) -> "VLMKVGenerator":
        model, processor = load_vlm(pretrained, device, dtype)
        return cls(model, processor, cache_kwargs, max_new_tokens, min_pixels, max_pixels)

    def _inputs(self, context: str, images: list) -> dict:
        content = _user_content(context or "", images)
        messages = [{"role": "user", "content": content}]
        size_kwargs = {}
        if self.qwen_sizing and images:
            sized = iter(qwen_vision_info(messages, self.processor, **self.pixel_limits)[0])
            messages = [{"role": "user", "content": [dict(c, image=next(sized)) if c["type"] == "image" else c
                                                     for c in content]}]
            size_kwargs = {"do_resize": False}
        enc = self.processor.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt",
            **size_kwargs,
        )
        param = next(self.model.parameters())
        out = {}
        for k, v in dict(enc).items():
            if isinstance(v, torch.Tensor):
                v = v.to(param.device)
                if torch.is_floating_point(v):
                    v = v.to(param.dtype)
                out[k] = v
        return out

    def generate(self, context: str, visuals=None, gen_kwargs: Mapping[str, Any] | None = None) -> str:
        gen_kwargs = dict(gen_kwargs or {})
        inputs = self._inputs(context, _as_images(visuals))
        cache = make_cache(self.model, **self.cache_kwargs)
        temperature = float(gen_kwargs.get("temperature") or 0.0)
        sample = bool(gen_kwargs.get("do_sample", False)) and temperature > 0
        kwargs: dict[str, Any] = {
            self.cache_kw: cache,
            "max_new_tokens": int(gen_kwargs.get("max_new_tokens") or self.max_new_tokens),
            "do_sample": sample,
        }
        if sample:
            kwargs["temperature"] = temperature
            if gen_kwargs.get("top_p") is not None:
                kwargs["top_p"] = float(gen_kwargs["top_p"])
        pad = getattr(self.tokenizer, "pad_token_id", None)
        if pad is not None:
            kwargs["pad_token_id"] = pad
        with torch.no_grad():
            out = self.model.generate(**inputs, **kwargs)
        new = out[0, inputs["input_ids"].shape[1]:]
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        if hasattr(cache, "kv_bytes"):
            self.last_kv_bytes = int(cache.kv_bytes()["total"])
        return _cut_at_stop(text, gen_kwargs.get("until"))


    def dialog(self, doc, context: str, visuals, doc_to_text, gen_kwargs: Mapping[str, Any] | None = None) -> tuple:
        """All rounds of one multi-round document on one cache: the rounds' answers, in order.

        Round 0 is ``context`` + ``visuals``; round ``r > 0`` comes from lmms-eval's
        ``doc_to_text(doc, previous_output=answers, round_idx=r, previous_round_info=info)``,
        which returns ``(visuals, context, terminal, answers, info)`` and ends the dialog with
        ``terminal``."""

        gen_kwargs = dict(gen_kwargs or {})
        if gen_kwargs.get("do_sample") and float(gen_kwargs.get("temperature") or 0) > 0:
            raise NotImplementedError("vlm_kv lmms-eval model: multi-round generation is greedy only")
        max_new = int(gen_kwargs.get("max_new_tokens") or self.max_new_tokens)
        cache = make_cache(self.model, **self.cache_kwargs)
        runner = DialogRunner(self.model, self.processor, cache, max_new_tokens=max_new, **self.pixel_limits)
        answers: list[str] = []
        info = None
        round_idx = 0
        while True:
            if round_idx > 0:
                visuals, context, terminal, answers, info = doc_to_text(
                    doc, previous_output=list(answers), round_idx=round_idx, previous_round_info=info)
                answers = list(answers)
                if terminal:
                    break
            images = _as_images(visuals)
            text = re.sub(r"<image>\s*", "", context or "").strip() if images else (context or "")
            turn = runner.run_turn(IMAGE_TAG * len(images) + text, images)
            answers.append(_cut_at_stop(turn.answer, gen_kwargs.get("until")))
            round_idx += 1
        if hasattr(cache, "kv_bytes"):
            self.last_kv_bytes = int(cache.kv_bytes()["total"])
        return tuple(answers)


def _user_content(context: str, images: list) -> list[dict]:
    """The user turn's content items: with one ``<image>`` marker per image, each image where its
    marker stands (the task placed it: smollava's tasks put a newline after it, as in training);
    otherwise every image first, then the text without markers."""
    if images and context.count("<image>") == len(images):
        content: list[dict] = []
        for k, chunk in enumerate(context.split("<image>")):
            if k:
                content.append({"type": "image", "image": images[k - 1]})
            if chunk.strip() or (k and chunk):
                content.append({"type": "text", "text": chunk})
        return content
    text = re.sub(r"<image>\s*", "", context).strip() if images else context
    return [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": text}]


def _cut_at_stop(text: str, until) -> str:
    for stop in [until] if isinstance(until, str) else (until or []):
        if stop and stop in text:
            text = text.split(stop, 1)[0]
    return text


# ----------------------------------------------------------------------------- lmms-eval class


def lmms_manifest():
    """lmms-eval's ``lmms_eval.models`` entry point: the manifest naming our model class."""
    # lazy: lmms-eval is optional (the lmms extra)
    from lmms_eval.models.registry_v2 import ModelManifest

    return ModelManifest(model_id=MODEL_NAME, simple_class_path=f"{__name__}.VLMKVLmms")


_CLASS = None


def lmms_class():
    """The lmms-eval model class (built and registered as ``vlm_kv`` on first call).

    Raises ImportError naming ``pip install lmms-eval`` when lmms-eval is not installed.
    """
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    try:
        from lmms_eval.api.model import lmms
    except ImportError as exc:
        raise ImportError(f"the lmms-eval integration needs lmms-eval, which is not installed: {INSTALL_HINT}") from exc

    class VLMKVLmms(lmms):
        """lmms-eval model: a local Qwen2.5-VL / LLaVA generating on a vlm-kv compressed cache."""

        is_simple = True

        def __init__(self, pretrained: str, **kwargs):
            load, cache = split_model_args({"pretrained": pretrained, **kwargs})
            self.pretrained = load["pretrained"]  # read by lmms' cache naming
            super().__init__()
            self.cache_kwargs = cache
            self.generator = VLMKVGenerator.from_pretrained(
                load["pretrained"], cache, device=load["device"], dtype=load["dtype"],
                max_new_tokens=load["max_new_tokens"], min_pixels=load.get("min_pixels"),
                max_pixels=load.get("max_pixels"),
            )

        def generate_until(self, requests) -> list[str]:
            results = []
            for request in tqdm(requests, desc=f"vlm_kv {self.cache_kwargs['policy']}@{self.cache_kwargs['budget']}",
                                disable=getattr(self, "rank", 0) != 0):
                contexts, gen_kwargs, doc_to_visual, doc_id, task, split = request.args
                visuals = doc_to_visual(self.task_dict[task][split][doc_id]) if doc_to_visual else []
                results.append(self.generator.generate(contexts, visuals, gen_kwargs))
            return results

        def loglikelihood(self, requests):
            raise NotImplementedError("vlm_kv lmms-eval model: loglikelihood is not implemented (generation tasks only)")

        def generate_until_multi_round(self, requests) -> list:
            results = []
            for request in requests:
                context, gen_kwargs, doc_to_visual, doc_to_text, doc_id, task, split = request.args
                doc = self.task_dict[task][split][doc_id]
                visuals = doc_to_visual(doc) if doc_to_visual else []
                results.append(self.generator.dialog(doc, context, visuals, doc_to_text, gen_kwargs))
            return results

    try:
        from lmms_eval.api.registry import register_model
    except ImportError:  # very old lmms-eval: pass the instance to simple_evaluate instead
        register_model = None
    if register_model is not None:
        VLMKVLmms = register_model(MODEL_NAME)(VLMKVLmms)
    _CLASS = VLMKVLmms
    return _CLASS


def __getattr__(name: str):
    if name == "VLMKVLmms":
        return lmms_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    """Register the model, then run lmms-eval's command line (``--model vlm_kv``)."""
    lmms_class()
    # lazy: lmms-eval is optional (the lmms extra)
    from lmms_eval.__main__ import cli_evaluate

    cli_evaluate()


# registered on import when lmms-eval is installed (its CLI resolves --model vlm_kv by registry)
def _installed() -> bool:
    try:
        return importlib.util.find_spec("lmms_eval") is not None
    except (ImportError, ValueError):  # a stubbed / half-imported module
        return False


if _installed():  # pragma: no cover - not installed here
    try:
        lmms_class()
    except ImportError as _exc:
        warnings.warn(f"vlm_kv lmms-eval model not registered: {_exc}", RuntimeWarning, stacklevel=2)


if __name__ == "__main__":  # pragma: no cover
    main()
