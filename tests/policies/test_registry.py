"""``build_policy``: scorer and allocation fields are checked by name before anything is built."""

import pytest

from vlm_kv.policies import build_policy
from vlm_kv.storage.allocation import GlobalTopK


def test_fields_reach_the_scorer_and_allocation():
    scorer, alloc = build_policy("snapkv", scorer_kwargs={"window": 8})
    assert scorer.window == 8
    _, alloc = build_policy("dbtrimkv", allocation_kwargs={"modality_cap": {"image": 0.3}})
    assert isinstance(alloc, GlobalTopK) and alloc.modality_cap == {"image": 0.3}


@pytest.mark.parametrize("kwargs, said", [
    ({"allocation_kwargs": {"windw": 3}}, "allocation GlobalTopK has no field 'windw'; its fields: min_per_head"),
    ({"scorer_kwargs": {"x": 1}}, "scorer RetentionScorer has no field 'x'"),
    ({"allocation": "global", "allocation_kwargs": {"y": 2}}, r"allocation 'global' \(GlobalTopK\) has no field 'y'"),
])
def test_an_unknown_field_is_refused_by_name(kwargs, said):
    with pytest.raises(ValueError, match=said):
        build_policy("dbtrimkv", **kwargs)
