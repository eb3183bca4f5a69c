"""The shipped gates: each model family finds its own, and no other model's."""

import json
import os

from vlm_kv.gates import PRETRAINED_DIR, SHIPPED, default_gates_for
from vlm_kv.gates.io import load_gates


def _fingerprint(folder: str) -> dict:
    with open(os.path.join(PRETRAINED_DIR, folder, "gate_config.json")) as fh:
        return json.load(fh)["model"]


def test_each_shipped_folder_loads_and_is_found_for_its_model():
    for folder in SHIPPED:
        fp = _fingerprint(folder)
        kind = load_gates(os.path.join(PRETRAINED_DIR, folder), fingerprint=fp).config.kind
        assert default_gates_for(fp, kind=kind) == os.path.join(PRETRAINED_DIR, folder)


def test_smollava_and_smollm2_share_a_language_model_but_not_gates():
    # smollava's LM is SmolLM2 (same config hash), yet each gets the gates trained on its own data
    text, visual = _fingerprint("smollm2-135m-dbtrimkv"), _fingerprint("smollava-dbtrimkv")
    assert text["config_hash"] == visual["config_hash"] and text["family"] != visual["family"]
    assert default_gates_for(visual).endswith("smollava-dbtrimkv")
    assert default_gates_for(text).endswith("smollm2-135m-dbtrimkv")
    assert default_gates_for({**visual, "family": "qwen2_vl"}) is None
