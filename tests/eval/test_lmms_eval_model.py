"""The optional lmms-eval model wrapper: what runs without lmms-eval installed."""

import sys
import types

import pytest
from PIL import Image

import vlm_kv
from vlm_kv.config import CacheOptions
from vlm_kv.eval import lmms_eval_model as lem
from vlm_kv.testing import tiny_model, tiny_processor


@pytest.fixture(scope="module")
def qwen():
    return tiny_model("qwen2_5_vl"), tiny_processor("qwen2_5_vl")


def test_model_args_string_splits_into_load_and_cache_kwargs():
    load, cache = lem.split_model_args("pretrained=/models/qwen,policy=snapkv,budget=0.1,evict_every=8,"
                                       "device=cpu,max_new_tokens=64")
    assert load == {"pretrained": "/models/qwen", "device": "cpu", "dtype": "auto", "max_new_tokens": 64}
    assert cache == {"policy": "snapkv", "budget": 0.1, "options": CacheOptions(evict_every=8)}
    assert lem.split_model_args("pretrained=/m,budget=256")[1] == {"policy": "snapkv", "budget": 256}
    assert lem.split_model_args("pretrained=/m")[1] == {"policy": "snapkv", "budget": 0.25}


def test_model_args_carry_every_tier_option_to_the_cache(qwen):
    _, cache = lem.split_model_args("pretrained=/m,policy=snapkv,budget=0.5,tiers=int2,int2_share=0.5,window=4,"
                                    "key_rope=post,spill=true,fp_unit=token")
    assert cache == {"policy": "snapkv", "budget": 0.5, "tiers": {"int2_share": 0.5, "window": 4,
                                                                  "key_rope": "post", "spill": True, "fp_unit": "token"}}
    built = vlm_kv.make_cache(qwen[0], **cache)
    assert built.tiers.window == 4 and built.tiers.spill and built.tiers.int2_share == 0.5
    assert built.tiers.fp_unit == "token"
    assert lem.split_model_args("pretrained=/m,tiers=int2,spill=0")[1]["tiers"] == {"spill": False}
    assert "tiers" not in lem.split_model_args("pretrained=/m,spill=0")[1]  # spill=0 alone asks for nothing
    with pytest.raises(ValueError, match="window= configure the INT2 tier: pass tiers=int2"):
        lem.split_model_args("pretrained=/m,window=4")
    assert lem.split_model_args("pretrained=/m,policy=qevict,budget=0.1,window=4")[1]["tiers"] == {"window": 4}
    with pytest.raises(ValueError, match="spill must be true or false"):
        lem.split_model_args("pretrained=/m,tiers=int2,spill=maybe")


def test_model_args_already_typed_by_lmms_eval():
    # lmms-eval converts numbers itself and adds batch_size / device from its own flags
    load, cache = lem.split_model_args({"pretrained": "/m", "policy": "snapkv", "budget": 256, "slack": 2.0,
                                        "batch_size": 1, "device": None})
    assert cache == {"policy": "snapkv", "budget": 256, "options": CacheOptions(slack=2)} and load["device"] is None


def test_model_args_full_takes_no_budget_and_a_bare_one_is_refused():
    assert lem.split_model_args("pretrained=/m,policy=full")[1] == {"policy": "full", "budget": 1.0}
    with pytest.raises(vlm_kv.BudgetError, match="'full' .* takes no budget"):
        lem.split_model_args("pretrained=/m,policy=full,budget=0.1")
    with pytest.raises(ValueError, match="'full' compresses nothing, so tiers="):
        lem.split_model_args("pretrained=/m,policy=full,tiers=int2")
    for typed in ("1", 1):  # as text, or as lmms-eval converts it
        with pytest.raises(vlm_kv.BudgetError, match="ambiguous"):
            lem.split_model_args({"pretrained": "/m", "policy": "snapkv", "budget": typed})
    with pytest.raises(vlm_kv.BudgetError, match="pass budget=1.0"):  # checked before any model loads
        lem.split_model_args("pretrained=/m,policy=kivi2,budget=0.5")


def test_model_args_errors():
    with pytest.raises(ValueError, match="pretrained"):
        lem.split_model_args("policy=snapkv")
    with pytest.raises(ValueError, match="unknown policy"):
        lem.split_model_args("pretrained=/m,policy=snapkvv")
    with pytest.raises(ValueError, match="budget"):
        lem.split_model_args("pretrained=/m,budget=lots")
    with pytest.raises(ValueError, match="evict_every"):
        lem.split_model_args("pretrained=/m,evict_every=1.5")
    with pytest.raises(ValueError, match="key=value"):
        lem.parse_model_args("pretrained")
    with pytest.warns(RuntimeWarning, match="colour"):
        lem.split_model_args("pretrained=/m,colour=blue")


def test_cache_kwargs_build_the_cache(qwen):
    model, _ = qwen
    _, cache_kw = lem.split_model_args("pretrained=/m,policy=streaming_llm,budget=48,evict_every=4")
    cache = vlm_kv.make_cache(model, **cache_kw)
    assert isinstance(cache, vlm_kv.CompressedCache)
    assert cache.budget.tokens_per_head == 48 and cache.evict_every == 4


def test_clear_import_error_without_lmms_eval(monkeypatch):
    for name in [m for m in sys.modules if m == "lmms_eval" or m.startswith("lmms_eval.")] + ["lmms_eval"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    monkeypatch.setattr(lem, "_CLASS", None)
    with pytest.raises(ImportError, match=r"pip install 'vlm-kv\[lmms\]'"):
        lem.lmms_class()
    with pytest.raises(ImportError, match=r"pip install 'vlm-kv\[lmms\]'"):
        lem.VLMKVLmms  # noqa: B018


def test_generator_runs_a_tiny_vlm_on_a_compressed_cache(qwen):
    model, processor = qwen
    gen = lem.VLMKVGenerator(model, processor, {"policy": "snapkv", "budget": 0.9}, max_new_tokens=4)
    image = Image.new("RGB", (32, 32), (200, 30, 30))
    prompt = "<image>\nWhat is in the picture? Please answer in a few words."
    text = gen.generate(prompt, [image], {"max_new_tokens": 4})
    assert isinstance(text, str) and gen.last_kv_bytes > 0
    assert gen.generate(prompt, [[image]], {"max_new_tokens": 4}) == text  # nested visual lists
    if len(text) > 1:
        stop = text[1]
        assert gen.generate(prompt, [image], {"max_new_tokens": 4, "until": [stop]}) == text.split(stop, 1)[0]
    with pytest.raises(FileNotFoundError):
        lem.VLMKVGenerator.from_pretrained("/nonexistent/model", {"policy": "full", "budget": 1.0})


def _stub_lmms_eval(monkeypatch):
    """The two lmms-eval modules the wrapper touches, reduced to their API."""
    registry: dict = {}

    class lmms:  # noqa: N801 - lmms-eval's name
        def __init__(self):
            self._rank, self._world_size, self.task_dict = 0, 1, {}

        @property
        def rank(self):
            return self._rank

    def register_model(*names):
        def deco(cls):
            for n in names:
                registry[n] = cls
            return cls

        return deco

    pkg, api = types.ModuleType("lmms_eval"), types.ModuleType("lmms_eval.api")
    model_mod, reg_mod = types.ModuleType("lmms_eval.api.model"), types.ModuleType("lmms_eval.api.registry")
    model_mod.lmms, reg_mod.register_model, reg_mod.MODEL_REGISTRY = lmms, register_model, registry
    for name, mod in (("lmms_eval", pkg), ("lmms_eval.api", api), ("lmms_eval.api.model", model_mod),
                      ("lmms_eval.api.registry", reg_mod)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(lem, "_CLASS", None)
    return registry


def test_lmms_class_registers_and_generates_with_a_stub_harness(monkeypatch, qwen):
    registry = _stub_lmms_eval(monkeypatch)
    model, processor = qwen
    made = {}

    def fake_from_pretrained(pretrained, cache_kwargs, **kw):
        made.update(pretrained=pretrained, cache_kwargs=dict(cache_kwargs), **kw)
        return lem.VLMKVGenerator(model, processor, cache_kwargs, kw["max_new_tokens"])

    monkeypatch.setattr(lem.VLMKVGenerator, "from_pretrained", staticmethod(fake_from_pretrained))
    cls = lem.lmms_class()
    assert registry["vlm_kv"] is cls and lem.lmms_class() is cls

    # lmms-eval: cls(**simple_parse_args_string(model_args), batch_size=..., device=...)
    lm = cls(pretrained="/models/qwen", policy="snapkv", budget=0.9, max_new_tokens=3, batch_size=1, device="cpu")
    assert made["cache_kwargs"] == {"policy": "snapkv", "budget": 0.9} and made["device"] == "cpu"
    image = Image.new("RGB", (32, 32), (10, 200, 10))
    lm.task_dict = {"demo": {"test": [{"img": image}, {"img": None}]}}
    reqs = [types.SimpleNamespace(args=("<image>\nDescribe the colour of this square.", {"max_new_tokens": 3},
                                        lambda doc: [doc["img"]], 0, "demo", "test")),
            types.SimpleNamespace(args=("Describe the colour of a green square in detail, please.", {"until": []},
                                        lambda doc: [doc["img"]], 1, "demo", "test"))]
    out = lm.generate_until(reqs)
    assert len(out) == 2 and all(isinstance(t, str) for t in out)
    with pytest.raises(NotImplementedError):
        lm.loglikelihood(reqs)
