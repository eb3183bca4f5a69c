import argparse

import pytest

from vlm_kv.gates.evaluate import cell_key, parse_cell


def test_cells_parse_gates_sinks_and_threshold():
    c = parse_cell("new:dbtrimkv_threshold:1.0:gates=runs/x,num_sinks=0,log_alpha=-6")
    assert (c["label"], c["policy"], c["budget"], c["gates"]) == ("new", "dbtrimkv_threshold", 1.0, "runs/x")
    assert c["scorer_kwargs"] == {"num_sinks": 0} and c["allocation_kwargs"] == {"log_alpha": -6.0}
    assert cell_key(c) != cell_key(parse_cell("new:dbtrimkv_threshold:1.0:gates=runs/x,num_sinks=0,log_alpha=-7"))
    assert cell_key(c) == cell_key(parse_cell("new:dbtrimkv_threshold:1.0:gates=runs/x,log_alpha=-6,num_sinks=0"))
    plain = parse_cell("base:snapkv:0.1")
    assert plain["gates"] is None and plain["scorer_kwargs"] == {}
    with pytest.raises(argparse.ArgumentTypeError, match="unknown cell option"):
        parse_cell("x:snapkv:0.1:window=3")
    with pytest.raises(argparse.ArgumentTypeError, match="LABEL:POLICY:BUDGET"):
        parse_cell("snapkv")
