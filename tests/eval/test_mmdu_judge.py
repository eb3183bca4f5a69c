"""MMDU judge: prompt layout, reply parsing, aggregation and ROUGE-L (hand-checked numbers)."""

import random

import pytest

from vlm_kv.eval.mmdu_judge import (
    ANSWER_END,
    ANSWER_START,
    DIMENSIONS,
    JUDGE_INSTRUCTIONS,
    OVERALL,
    QUESTION_HEADER,
    REFERENCE_END,
    REFERENCE_START,
    SCORE_KEYS,
    aggregate,
    build_judge_prompt,
    judge_name,
    lcs_length,
    parse_judge_output,
    rouge_l,
    rouge_tokens,
)

LONG_EXPLANATION = """\
**Creativity**: The assistant mostly restates what the images show and adds little of its own. \
It does not offer the historical framing the reference gives. Score: 6

**Richness**: It covers the main points {in broad strokes} but lacks the examples of the reference. Score: 7

**Visual Perception**: It mislabels the bridge in Image 2 as a viaduct; the colours are right. Score: 5

**Logical Coherence**: The argument flows well and the comparison is consistent. Score: 8

**Answer Accuracy**: Mostly correct, one factual slip about the construction year. Score: 7

**Image Relationship Understanding**: It treats the two images separately and hardly relates them. Score: 4

**Overall Score**: A reasonable but uneven answer. Score: 6

{'Creativity': 6, 'Richness': 7, 'Visual Perception': 5, 'Logical Coherence': 8, 'Answer Accuracy': 7, 'Image Relationship Understanding': 4, 'Overall Score': 6}
"""

FENCED_JSON = """\
Here is my evaluation.

```json
{
  "creativity": 8,
  "RICHNESS": "7",
  "visual_perception": 6.5,
  "Logical-Coherence": 9,
  "answer accuracy": 8,
  "Image Relationship  Understanding": 6,
  "overall score": 7,
}
```
"""

EXPECTED_1 = {
    "Creativity": 6.0,
    "Richness": 7.0,
    "Visual Perception": 5.0,
    "Logical Coherence": 8.0,
    "Answer Accuracy": 7.0,
    "Image Relationship Understanding": 4.0,
    "Overall Score": 6.0,
}


def test_prompt_layout_and_rubric():
    p = build_judge_prompt("Q? <ImageHere>", "REF TEXT", "ANS TEXT")
    assert p.startswith(JUDGE_INSTRUCTIONS)
    order = [QUESTION_HEADER, "Q? <ImageHere>", REFERENCE_START, "REF TEXT", REFERENCE_END, ANSWER_START, "ANS TEXT", ANSWER_END]
    pos = [p.index(x) for x in order]
    assert pos == sorted(pos)
    assert p.rstrip().endswith(ANSWER_END)
    assert ANSWER_START == "[The Start of Assistant's Answer]"
    for dim in DIMENSIONS + (OVERALL,):
        assert f"\n{dim} (" in JUDGE_INSTRUCTIONS
    # five bands per dimension and for the overall score
    for band in ("1-2:", "3-4:", "5-6:", "7-8:", "9-10:"):
        assert JUDGE_INSTRUCTIONS.count(band) == 7
    assert "reference answer" in JUDGE_INSTRUCTIONS
    # the instructions' own key template carries no numbers: it must not parse as scores
    assert parse_judge_output(JUDGE_INSTRUCTIONS).scores is None


def test_parse_long_explanation_then_python_dict():
    r = parse_judge_output(LONG_EXPLANATION)
    assert r.scores == EXPECTED_1
    assert r.error is None and r.ok
    assert list(r.scores) == list(SCORE_KEYS)


def test_parse_fenced_json_mixed_keys_string_and_float_values_trailing_comma():
    r = parse_judge_output(FENCED_JSON)
    assert r.ok
    assert r.scores == {
        "Creativity": 8.0,
        "Richness": 7.0,
        "Visual Perception": 6.5,
        "Logical Coherence": 9.0,
        "Answer Accuracy": 8.0,
        "Image Relationship Understanding": 6.0,
        "Overall Score": 7.0,
    }


def test_parse_missing_overall_is_partial_with_reason():
    text = "Fine.\n{'Creativity': 2, 'Richness': 3, 'Visual Perception': 4, 'Logical Coherence': 5, 'Answer Accuracy': 6, 'Image Relationship Understanding': 7}"
    r = parse_judge_output(text)
    assert r.scores == {"Creativity": 2.0, "Richness": 3.0, "Visual Perception": 4.0, "Logical Coherence": 5.0,
                        "Answer Accuracy": 6.0, "Image Relationship Understanding": 7.0}
    assert not r.ok
    assert "Overall Score" in r.error


def test_parse_overall_alias_and_spacing():
    r = parse_judge_output('{"Overall": 9}')
    assert r.scores == {"Overall Score": 9.0}
    r = parse_judge_output("{'OverallScore': 4, 'VISUAL PERCEPTION': 3}")
    assert r.scores == {"Visual Perception": 3.0, "Overall Score": 4.0}
    r = parse_judge_output("{'overall_score': '8/10'}")
    assert r.scores == {"Overall Score": 8.0}


@pytest.mark.parametrize(
    "text, reason",
    [
        ("The answer is good. {'Creativity': 7, 'Richness': 6, 'Visual Perc", "truncated"),
        ("I would give it a seven overall.", "no {...}"),
        ("", "empty"),
        (None, "empty"),
        ("{'Creativity': 'high', 'Overall Score': 'N/A'} and {x}", "none of the 2"),
        ("\u00e9\u0000\u0018\u0002garbage bytes %$#", "no {...}"),
    ],
)
def test_parse_failures_return_none_and_reason(text, reason):
    r = parse_judge_output(text)
    assert r.scores is None
    assert not r.ok
    assert reason in r.error


def test_scores_clipped_to_0_10():
    r = parse_judge_output("{'Creativity': 12, 'Richness': -2, 'Visual Perception': 10.5, 'Overall Score': '11/10'}")
    assert r.scores == {"Creativity": 10.0, "Richness": 0.0, "Visual Perception": 10.0, "Overall Score": 10.0}


def test_several_dicts_last_score_dict_wins():
    text = (
        "Format reminder: {'Dimension One': Score, 'Dimension Two': Score, ..., 'Overall Score': Score}\n"
        "Draft: {'Creativity': 3, 'Richness': 3, 'Visual Perception': 3, 'Logical Coherence': 3, "
        "'Answer Accuracy': 3, 'Image Relationship Understanding': 3, 'Overall Score': 3}\n"
        "After reconsidering:\n"
        "{'Creativity': 8, 'Richness': 8, 'Visual Perception': 7, 'Logical Coherence': 8, "
        "'Answer Accuracy': 9, 'Image Relationship Understanding': 7, 'Overall Score': 8}\n"
        "Note: {see above}."
    )
    r = parse_judge_output(text)
    assert r.ok
    assert r.scores["Overall Score"] == 8.0 and r.scores["Creativity"] == 8.0 and r.scores["Answer Accuracy"] == 9.0


def test_aggregate_hand_checked():
    q1 = EXPECTED_1  # C6 R7 VP5 LC8 AA7 IRU4 O6
    q2 = parse_judge_output(FENCED_JSON).scores  # C8 R7 VP6.5 LC9 AA8 IRU6 O7
    q3 = {"Creativity": 2.0, "Richness": 3.0, "Visual Perception": 4.0, "Logical Coherence": 5.0,
          "Answer Accuracy": 6.0, "Image Relationship Understanding": 7.0}  # no Overall
    agg = aggregate([q1, q2, q3, None])
    assert agg["n_judged"] == 4
    assert agg["n_parse_failures"] == 1
    assert agg["n_incomplete"] == 1
    # all: failures / missing count 0, divided by all 4 judged questions, x10
    assert agg["all"]["Overall Score"] == pytest.approx((6 + 7) / 4 * 10)  # 32.5
    assert agg["all"]["Creativity"] == pytest.approx((6 + 8 + 2) / 4 * 10)  # 40.0
    assert agg["all"]["Visual Perception"] == pytest.approx((5 + 6.5 + 4) / 4 * 10)  # 38.75
    # valid: only where parsed
    assert agg["valid"]["Overall Score"] == pytest.approx(65.0)
    assert agg["valid"]["Creativity"] == pytest.approx(160 / 3)
    assert agg["valid"]["Image Relationship Understanding"] == pytest.approx((4 + 6 + 7) / 3 * 10)
    assert agg["n_valid"]["Overall Score"] == 2 and agg["n_valid"]["Richness"] == 3


def test_aggregate_edge_cases():
    agg = aggregate([])
    assert agg["n_judged"] == 0 and agg["all"]["Overall Score"] is None and agg["valid"]["Overall Score"] is None
    agg = aggregate([None, None])
    assert agg["n_parse_failures"] == 2
    assert agg["all"]["Overall Score"] == 0.0
    assert agg["valid"]["Overall Score"] is None


def test_rouge_tokens_split_whitespace_and_punctuation():
    assert rouge_tokens("The cat, sat!  On\tthe-mat.") == ["the", "cat", "sat", "on", "the", "mat"]
    assert rouge_tokens(None) == [] and rouge_tokens("...") == []


def test_rouge_l_hand_checked():
    # LCS(the cat sat on the mat, the cat is on the mat) = the cat on the mat = 5; P = R = 5/6
    assert rouge_l("the cat sat on the mat", "the cat is on the mat") == pytest.approx(5 / 6)
    # LCS 2; P = 2/4, R = 2/2; F = 2PR/(P+R) = 2/3
    assert rouge_l("a b c d", "a c") == pytest.approx(2 / 3)
    assert rouge_l("The CAT, sat!", "the cat sat.") == pytest.approx(1.0)
    # order matters: LCS(a b c, c b a) = 1; P = R = 1/3
    assert rouge_l("a b c", "c b a") == pytest.approx(1 / 3)
    assert rouge_l("", "a b") == 0.0 and rouge_l("x y", "a b") == 0.0 and rouge_l(None, None) == 0.0


def _lcs_dp(a, b):
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def test_bit_parallel_lcs_matches_dynamic_programming():
    rng = random.Random(0)
    for _ in range(300):
        a = [rng.choice("abcde") for _ in range(rng.randint(0, 40))]
        b = [rng.choice("abcdef") for _ in range(rng.randint(0, 70))]
        assert lcs_length(a, b) == _lcs_dp(a, b)
    assert lcs_length(list("ABCBDAB"), list("BDCABA")) == 4


def test_judge_name_for_plain_callable():
    def my_judge(prompt):
        return ""

    assert judge_name(my_judge)["name"] == "my_judge"
    assert judge_name(None) == {"name": None}
