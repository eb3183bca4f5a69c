"""Random scenarios (hypothesis): any family, policy, budget, prompt length, decode length, second
turn with or without images, batch with left padding, eviction interval and slack.

In every scenario: no crash, the key/value bytes held stay within the budget after every
eviction step and never exceed what a DynamicCache holds for the same tokens, and a budget at
least as large as the sequence reproduces DynamicCache. Batch invariance: a prompt run alone
gets the same next-token logits as the same prompt in a left-padded batch, for every policy,
tiered and untiered.
"""
import functools

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

import vlm_kv
from vlm_kv.config import BudgetError, CacheOptions
from vlm_kv.policies import POLICIES
from vlm_kv.cache.report import layer_tensor_bytes
from vlm_kv.testing import record_evictions, tiny_gates, tiny_inputs, tiny_model

FAMILIES = ("llama", "qwen2", "qwen3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava")
TEXT_ONLY = {"llama", "qwen2", "qwen3"}
SCENARIOS_RUN = []  # read by conftest's summary: how many scenarios ran


@functools.lru_cache(maxsize=None)
def _model(family):
    return tiny_model(family)


@functools.lru_cache(maxsize=None)
def _gates(family, kind):
    return tiny_gates(_model(family), kind=kind)


scenario = st.fixed_dictionaries({
    "family": st.sampled_from(FAMILIES),
    # kvzip is filled by its reconstruction pass, not a plain forward: tests/test_reconstruction.py
    "policy": st.sampled_from(sorted(p for p, spec in POLICIES.items()
                                     if not spec.needs_strategy and not spec.needs_reconstruction)),
    "budget": st.one_of(st.sampled_from([1.0, 0.5, 0.25, 0.1, 0.05]), st.integers(min_value=2, max_value=40)),
    "prompt": st.integers(min_value=1, max_value=60),
    "decode": st.integers(min_value=1, max_value=12),
    "second_turn": st.sampled_from([None, "text", "image"]),
    "batch": st.sampled_from([1, 2]),
    "left_pad": st.integers(min_value=0, max_value=4),
    "evict_every": st.integers(min_value=1, max_value=6),
    "slack": st.integers(min_value=0, max_value=2),
    "images": st.integers(min_value=0, max_value=2),
    "tiers": st.sampled_from([None, None, "int2"]),
    "window": st.integers(min_value=1, max_value=8),
})


def _conversation(model, cache, sc):
    family = sc["family"]
    images = 0 if family in TEXT_ONLY else sc["images"]
    left_pad = sc["left_pad"] if sc["batch"] > 1 else 0
    if images == 0 and sc["batch"] == 1:  # any length, down to a single token
        ids = torch.randint(16, model.config.get_text_config().vocab_size, (1, sc["prompt"]),
                            generator=torch.Generator().manual_seed(1))
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    else:
        inputs = tiny_inputs(model, batch_size=sc["batch"], num_images=images,
                             text_len=max(sc["prompt"], 2 + left_pad * (sc["batch"] - 1)), left_pad=left_pad, seed=1)
    n = sc["decode"]
    out = model.generate(**inputs, cache=cache, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    qwen = family.startswith("qwen")
    if sc["second_turn"] is None or (qwen and sc["batch"] > 1):
        # transformers' Qwen forward cannot take a padded batch's mask on a later turn (DynamicCache fails too)
        return out
    more = 0 if sc["second_turn"] == "text" or family in TEXT_ONLY else 1
    if family.startswith("qwen") and images == 0:
        more = 0  # transformers' own M-RoPE fails on an image turn after an image-free prefill (DynamicCache too)
    turn = tiny_inputs(model, batch_size=sc["batch"], num_images=more, text_len=5, seed=2)
    # the new turn's tokens only, with its own images, on top of the cache (the forward-level
    # pattern; generate would need the whole conversation's ids, see examples/)
    mask = torch.cat([inputs["attention_mask"], torch.ones(sc["batch"], out.shape[1] - inputs["attention_mask"].shape[1],
                                                           dtype=torch.long)], dim=1)
    tokens = []
    with torch.no_grad():
        step = {k: v for k, v in turn.items() if k != "attention_mask"}
        for _ in range(3):
            mask = torch.cat([mask, torch.ones(sc["batch"], step["input_ids"].shape[1], dtype=torch.long)], dim=1)
            # Qwen derives M-RoPE positions from the cache length and its rope deltas when no mask is given
            masked = {} if qwen else {"attention_mask": mask}
            logits = model(**step, **masked, cache=cache, use_cache=True).logits
            step = {"input_ids": logits[:, -1:].argmax(-1)}
            tokens.append(step["input_ids"])
    return torch.cat([out, *tokens], dim=1)


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.generate])
@given(sc=scenario)
def test_random_scenarios_hold_the_budget_and_match_dynamic_cache_at_full_budget(sc):
    model = _model(sc["family"])
    spec = POLICIES[sc["policy"]]
    kwargs = dict(options=CacheOptions(evict_every=sc["evict_every"], slack=sc["slack"]))
    if sc["tiers"] and spec.tierable and spec.default_tiers is None:
        kwargs.update(tiers={"window": sc["window"]})
    if spec.needs_gates:
        kwargs["gates"] = _gates(sc["family"], spec.gate_kind)
    budget = sc["budget"]
    if not spec.allocation().bounded_by_budget and budget != 1.0:
        with pytest.raises(BudgetError, match="budget=1.0"):
            vlm_kv.make_cache(model, policy=sc["policy"], budget=budget, **kwargs)
        return
    scorer_sinks = spec.scorer().sinks
    if isinstance(budget, int) and budget > 1 and budget - sc["slack"] < scorer_sinks:
        with pytest.raises(BudgetError, match="attention sinks"):
            vlm_kv.make_cache(model, policy=sc["policy"], budget=budget, **kwargs)
        return
    cache = vlm_kv.make_cache(model, policy=sc["policy"], budget=budget, **kwargs)
    held_after = record_evictions(cache)
    if spec.visual_only:
        try:
            out = _conversation(model, cache, sc)
        except ValueError as err:  # a clear refusal: the budget cannot hold the text these policies never evict
            assert "never evicts text tokens" in str(err)
            return
    else:
        out = _conversation(model, cache, sc)
    SCENARIOS_RUN.append(sc)
    assert held_after  # an eviction step follows every prompt, a one-token prompt included
    for held, allowed in held_after:
        assert held <= allowed
    full = DynamicCache(config=model.config)
    ref = _conversation(model, full, sc)
    # never more than the full cache: keys and values held, spare decode room included, against
    # what a DynamicCache holds for the same tokens (the same number of steps, so the same length)
    assert ref.shape == out.shape and cache.kv_bytes()["total"] <= layer_tensor_bytes(full)
    if budget == 1.0 and sc["slack"] == 0 and spec.allocation().bounded_by_budget:
        assert torch.equal(out, ref)


# ----------------------------------------------------------------------------- batch invariance

BATCH_FAMILIES = ("llama", "qwen2", "qwen3", "llava", "qwen2_5_vl")

batch_scenario = st.fixed_dictionaries({
    "family": st.sampled_from(BATCH_FAMILIES),
    # kvzip is filled by its reconstruction pass, not a plain forward: tests/test_reconstruction.py
    "policy": st.sampled_from(sorted(p for p, spec in POLICIES.items()
                                     if not spec.needs_strategy and not spec.needs_reconstruction)),
    "tiers": st.sampled_from([None, "int2"]),
    "budget": st.one_of(st.sampled_from([1.0, 0.5, 0.25, 0.1, 0.05]), st.integers(min_value=2, max_value=40)),
    "short": st.integers(min_value=1, max_value=12),
    "long": st.integers(min_value=16, max_value=80),
    "decode": st.integers(min_value=1, max_value=10),
    "evict_every": st.integers(min_value=1, max_value=6),
    "window": st.integers(min_value=1, max_value=8),
    "images": st.integers(min_value=0, max_value=1),
})


class _ForcedTokens(LogitsProcessor):
    """Records each step's raw logits, then forces the next token from a fixed list: every run feeds
    the same tokens, so rows compare logit by logit (no greedy tie can make them part ways)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.logits = tokens, []

    def __call__(self, input_ids, scores):
        self.logits.append(scores.detach().clone())
        forced = torch.full_like(scores, float("-inf"))
        forced[:, self.tokens[len(self.logits) - 1]] = 0.0
        return forced


def _one_row(model, n: int, images: int, seed: int) -> dict:
    if images == 0:  # any length, down to a single token
        ids = torch.randint(16, model.config.get_text_config().vocab_size, (1, n),
                            generator=torch.Generator().manual_seed(seed))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return tiny_inputs(model, batch_size=1, num_images=images, text_len=max(n, 2), seed=seed)


def _left_padded(rows: list[dict]) -> dict:
    """One batch of single rows: token tensors left-padded with pad id 0 (mask 0), vision tensors
    concatenated in row order (as a processor lays out a batch)."""
    length = max(r["input_ids"].shape[1] for r in rows)
    batch = {}
    for key in rows[0]:
        parts = [r[key] for r in rows]
        if key in ("input_ids", "attention_mask", "mm_token_type_ids"):
            parts = [torch.nn.functional.pad(t, (length - t.shape[1], 0), value=0) for t in parts]
        batch[key] = torch.cat(parts)
    return batch


def _forced_logits(model, cache_factory, inputs: dict, tokens: list[int]) -> torch.Tensor:
    """[B, steps, V] raw logits of each step of ``generate`` fed ``tokens``."""
    forced = _ForcedTokens(tokens)
    model.generate(**inputs, cache=cache_factory(), max_new_tokens=len(tokens), min_new_tokens=len(tokens),
                   do_sample=False, logits_processor=LogitsProcessorList([forced]))
    return torch.stack(forced.logits, dim=1)


def _batch_settings(sc) -> tuple[object, dict]:
    """(budget, make_cache keywords) of a scenario, mapped onto settings the policy takes."""
    spec = POLICIES[sc["policy"]]
    family = sc["family"]
    kwargs = {"options": CacheOptions(evict_every=sc["evict_every"])}
    if sc["tiers"] and spec.tierable and spec.default_tiers is None:
        kwargs.update(tiers={"window": sc["window"]})
    if spec.needs_gates:
        kwargs["gates"] = _gates(family, spec.gate_kind)
    budget = sc["budget"]
    if not spec.allocation().bounded_by_budget:
        budget = 1.0  # kivi2, dbtrimkv_threshold: their own rule decides
    elif isinstance(budget, int):
        budget = max(budget, spec.scorer().sinks)  # a token budget holds the sinks
    return budget, kwargs


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.generate])
@given(sc=batch_scenario)
def test_a_row_alone_equals_the_same_row_in_a_padded_batch(sc):
    model = _model(sc["family"])
    images = 0 if sc["family"] in TEXT_ONLY else sc["images"]
    budget, kwargs = _batch_settings(sc)

    def new_cache():
        return vlm_kv.make_cache(model, policy=sc["policy"], budget=budget, **kwargs)

    rows = [_one_row(model, sc["short"], images, seed=3), _one_row(model, sc["long"], images, seed=4)]
    tokens = torch.randint(16, 200, (sc["decode"],), generator=torch.Generator().manual_seed(5)).tolist()
    alone, refused = [], False
    for row in rows:
        try:
            alone.append(_forced_logits(model, new_cache, row, tokens)[0])
        except ValueError as err:  # a visual-only policy whose budget cannot hold a row's text
            assert "never evicts text tokens" in str(err)
            refused = True
    if refused:  # the batch holds that row too: refused as well
        with pytest.raises(ValueError, match="never evicts text tokens"):
            _forced_logits(model, new_cache, _left_padded(rows), tokens)
        return
    batched = _forced_logits(model, new_cache, _left_padded(rows), tokens)
    for b, logits in enumerate(alone):
        torch.testing.assert_close(batched[b], logits, atol=1e-4, rtol=1e-4,
                                   msg=lambda m: f"row {b} ({sc}): its batch changed its logits: {m}")
