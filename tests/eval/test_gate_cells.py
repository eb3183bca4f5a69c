import argparse

import pytest

from vlm_kv.eval.gate_cells import cell_key, parse_cell


def test_cells_parse_gates_sinks_and_threshold():
    c = parse_cell("new:dbtrimkv_threshold:1.0:gates=runs/x,num_sinks=0,log_alpha=-6")
    assert (c["label"], c["policy"], c["budget"], c["gates"]) == ("new", "dbtrimkv_threshold", 1.0, "runs/x")
    assert c["scorer_kwargs"] == {"num_sinks": 0} and c["allocation_kwargs"] == {"log_alpha": -6.0}
    assert cell_key(c) != cell_key(parse_cell("new:dbtrimkv_threshold:1.0:gates=runs/x,num_sinks=0,log_alpha=-7"))
    assert cell_key(c) == cell_key(parse_cell("new:dbtrimkv_threshold:1.0:gates=runs/x,log_alpha=-6,num_sinks=0"))
    plain = parse_cell("base:snapkv:0.1")
    assert plain["gates"] is None and plain["scorer_kwargs"] == {}
    with pytest.raises(argparse.ArgumentTypeError, match="unknown cell option"):
        parse_cell("x:snapkv:0.1:colour=3")
    with pytest.raises(argparse.ArgumentTypeError, match="LABEL:POLICY:BUDGET"):
        parse_cell("snapkv")


def test_cells_take_tier_and_recent_options_and_key_them_with_the_dtype():
    c = parse_cell("q:qevict:0.05:tiers=int2,int2_share=0.5,window=8,recent_ratio=0.5")
    assert c["cache_kwargs"] == {"tiers": "int2", "int2_share": 0.5, "window": 8}
    assert c["scorer_kwargs"] == {"recent_ratio": 0.5}
    assert parse_cell("f:dbtrimkv:0.1:min_per_head=16")["allocation_kwargs"] == {"min_per_head": 16}
    assert cell_key(c) != cell_key(parse_cell("q:qevict:0.05:tiers=int2,int2_share=0.7,window=8,recent_ratio=0.5"))
    bf16 = dict(c, dtype="bfloat16")
    assert cell_key(bf16) != cell_key(dict(c, dtype="float32"))
    # rows written before the tier options and --dtype existed keep their keys (a grid resumes)
    old_row = {"label": "base", "policy": "snapkv", "budget": 0.1, "gates": None, "scorer_kwargs": {},
               "allocation_kwargs": {}}
    assert cell_key(old_row) == cell_key(dict(parse_cell("base:snapkv:0.1"), dtype="float32"))


def test_cell_keys_tell_passages_apart():
    row = dict(parse_cell("s:dbtrimkv:0.1"), dtype="float32", text="pg84.txt", context=2048, continuation=128)
    assert cell_key(dict(row, offset=100000)) != cell_key(dict(row, offset=175000))
    assert cell_key(dict(row, offset=100000)) == cell_key(dict(row, offset=100000))


def test_cells_take_the_eviction_interval_into_the_cache_options():
    from vlm_kv.eval.gate_cells import cell_cache_kwargs

    c = parse_cell("e:dbtrimkv:0.1:tiers=int2,evict_every=16")
    assert c["cache_kwargs"] == {"tiers": "int2", "evict_every": 16}
    kwargs = cell_cache_kwargs(c)
    assert kwargs["options"].evict_every == 16 and kwargs["tiers"] == "int2"
    assert cell_cache_kwargs(parse_cell("e:dbtrimkv:0.1:tiers=int2"))["options"].evict_every is None
    assert cell_key(c) != cell_key(parse_cell("e:dbtrimkv:0.1:tiers=int2"))


def test_cells_can_name_the_decode_attention_path():
    from vlm_kv.eval.gate_cells import cell_cache_kwargs

    c = parse_cell("t:dbtrimkv:0.1:tiers=int2,attention_backend=torch")
    assert cell_cache_kwargs(c)["options"].attention_backend == "torch"
    assert cell_cache_kwargs(parse_cell("t:dbtrimkv:0.1:tiers=int2"))["options"].attention_backend == "auto"
    assert cell_key(c) != cell_key(parse_cell("t:dbtrimkv:0.1:tiers=int2"))
    with pytest.raises(ValueError, match="attention_backend"):
        cell_cache_kwargs(parse_cell("t:dbtrimkv:0.1:attention_backend=cuda-ish"))
