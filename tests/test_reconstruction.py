"""Policy kvzip: scores from a reconstruction pass (tiny random models: code paths only)."""

import pytest
import torch
from transformers import DynamicCache

import vlm_kv
from vlm_kv.policies.kvzip import MissingReconstructionScores
from vlm_kv.reconstruction import ReadBack, chat_wrapping, kvzip_prefill, plan_read_back, reconstruction_scores
from vlm_kv.testing import random_tokens, tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama"), tiny_tokenizer("llama")


def _chat_context(tok, n_words: int = 12) -> torch.Tensor:
    text = " ".join(f"w{i}" for i in range(n_words))
    return tok.apply_chat_template([{"role": "user", "content": text}], return_tensors="pt", return_dict=True)["input_ids"]


def test_the_plan_reads_the_context_after_the_template_header_in_chunks(llama):
    model, tok = llama
    ids = _chat_context(tok)
    header, reply = chat_wrapping(tok)
    n_head = tok(header, add_special_tokens=False, return_tensors="pt").input_ids.shape[1]
    prompt = tok(ReadBack().prompt, add_special_tokens=False, return_tensors="pt").input_ids[0]
    suffix = tok(reply, add_special_tokens=False, return_tensors="pt").input_ids[0]
    plan = plan_read_back(tok, ids, ReadBack(chunk=7, overlap=3))
    assert plan[0].start == n_head > 0 and plan[-1].end == ids.shape[1]
    assert all(a.end == b.start and b.end - b.start <= 7 for a, b in zip(plan, plan[1:]))
    first = plan[0].reading[0]
    assert torch.equal(first[: len(prompt)], prompt)
    assert torch.equal(first[len(prompt): len(prompt) + len(suffix)], suffix)
    assert torch.equal(first[len(prompt) + len(suffix):], ids[0, plan[0].start:plan[0].end])
    later = plan[1].reading[0]  # a later chunk quotes the end of the one before it, then reads on
    assert torch.equal(later[-(7 + len(suffix) + 3): -(7 + len(suffix))], ids[0, plan[1].start - 3: plan[1].start])
    # the header is read back when asked, and a context without it is read from its start
    assert plan_read_back(tok, ids, ReadBack(skip_template_prefix=False))[0].start == 0
    assert plan_read_back(tok, random_tokens(20, seed=4))[0].start == 0
    newline = plan_read_back(tok, ids, ReadBack(assistant_turn=False))[0].reading[0]
    assert torch.equal(newline[len(prompt): -(ids.shape[1] - n_head)],
                       tok("\n", add_special_tokens=False, return_tensors="pt").input_ids[0])
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        ReadBack(chunk=0)


@pytest.mark.parametrize("local", [True, False])
def test_scores_are_the_most_attention_any_reading_query_pays(llama, local):
    model, tok = llama
    ids = _chat_context(tok)
    p = ids.shape[1]
    plan = plan_read_back(tok, ids, ReadBack(chunk=9))
    assert len(plan) >= 3
    got = reconstruction_scores(model, ids, plan, sinks=2, local_softmax=local)
    # each chunk by itself: one eager pass over the context then its reading (no other read-back)
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    kv = model.config.num_key_value_heads
    expected = [torch.zeros(1, kv, p) for _ in got]
    try:
        for c in plan:
            attn = model(input_ids=torch.cat([ids, c.reading], 1), output_attentions=True).attentions
            for layer, probs in enumerate(attn):
                probs = probs[:, :, p:].float()
                lo, hi = (c.start, c.end) if local else (0, p)
                if local:
                    keep = torch.zeros(probs.shape[-1], dtype=torch.bool)
                    keep[:2] = keep[c.start:c.end] = keep[p:] = True
                    probs = probs * keep
                    probs = probs / probs.sum(-1, keepdim=True)
                seen = probs[..., lo:hi].amax(2).reshape(1, kv, -1, hi - lo).amax(2)
                expected[layer][..., lo:hi] = torch.maximum(expected[layer][..., lo:hi], seen)
    finally:
        model.set_attn_implementation(before)
    for layer in range(len(got)):
        torch.testing.assert_close(got[layer], expected[layer], atol=1e-5, rtol=1e-4)
        if local:  # the header is not read back: it scores 0
            assert float(got[layer][..., : plan[0].start].abs().max()) == 0.0
    assert model.config._attn_implementation == before
    with pytest.raises(ValueError, match="does not fit"):
        reconstruction_scores(model, ids[:, :5], plan)


def test_kvzip_keeps_the_entries_reconstruction_reads_most(llama):
    model, tok = llama
    ids = random_tokens(40, seed=2)
    cache = vlm_kv.make_cache(model, "kvzip", 0.3, options=vlm_kv.CacheOptions(evict_every=1 << 20))
    kvzip_prefill(model, cache, ids, tok)
    scores = cache.scorer.scores_by_position
    kept, dropped = [], []
    for i, layer in enumerate(cache.layers):
        positions = layer.store.padded_view(states=()).positions[0]  # [H, L]
        for h in range(positions.shape[0]):
            held = set(positions[h][positions[h] >= 0].tolist())
            for p in range(cache.scorer.num_sinks, 40):
                (kept if p in held else dropped).append(float(scores[i][0, h, p]))
    assert kept and dropped and min(kept) >= max(dropped) - 1e-6  # one global ranking, sinks aside
    assert cache.kv_bytes()["total"] <= cache.budget_bytes()


def test_full_budget_answers_as_the_full_cache_and_misuse_fails_closed(llama):
    model, tok = llama
    ids = random_tokens(30, seed=3)
    cache = vlm_kv.make_cache(model, "kvzip", 1.0)
    kvzip_prefill(model, cache, ids[:, :-1], tok)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                         max_new_tokens=6, do_sample=False)
    ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=DynamicCache(),
                         max_new_tokens=6, do_sample=False)
    assert torch.equal(out, ref)
    with pytest.raises(MissingReconstructionScores, match="kvzip_prefill"):
        model(input_ids=ids, past_key_values=vlm_kv.make_cache(model, "kvzip", 0.3), use_cache=True)
    with pytest.raises(ValueError, match="empty cache"):
        kvzip_prefill(model, cache, ids, tok)
    with pytest.raises(ValueError, match="policy 'kvzip'"):
        kvzip_prefill(model, vlm_kv.make_cache(model, "snapkv", 0.3), ids, tok)


def test_a_memo_reads_each_context_back_once(llama, monkeypatch):
    import vlm_kv.reconstruction as R

    model, tok = llama
    ids = random_tokens(30, seed=5)
    memo: dict = {}
    kvzip_prefill(model, vlm_kv.make_cache(model, "kvzip", 0.3), ids, tok, memo=memo)
    first = next(iter(memo.values()))
    def read_back_again(*args, **kwargs):
        raise RuntimeError("read back again")

    monkeypatch.setattr(R, "reconstruction_scores", read_back_again)
    cache = vlm_kv.make_cache(model, "kvzip", 0.5)
    kvzip_prefill(model, cache, ids, tok, memo=memo)
    assert len(memo) == 1 and cache.scorer.scores_by_position[0] is not None
    torch.testing.assert_close(cache.scorer.scores_by_position[0], first[0].float())
    with pytest.raises(RuntimeError, match="read back again"):  # another layout is another entry
        kvzip_prefill(model, vlm_kv.make_cache(model, "kvzip", 0.5), ids, tok, ReadBack(chunk=8), memo=memo)
