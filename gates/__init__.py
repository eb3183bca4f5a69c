"""Learned retention gates (TrimKV / DBTrimKV): modules, saving, hooks, shipped defaults."""

from __future__ import annotations

import os

from vlm_kv.gates.io import CONFIG, GateMismatchError, check_fits, load_config

PRETRAINED_DIR = os.path.join(os.path.dirname(__file__), "pretrained")
SHIPPED = ("smollm2-135m-dbtrimkv", "smollm2-135m-trimkv", "smollava-dbtrimkv")


def default_gates_for(fingerprint: dict, kind: str = "dbtrimkv") -> str | None:
    """Folder of the shipped gates of ``kind`` that fit the model with ``fingerprint``, or None."""
    for folder in SHIPPED:
        path = os.path.join(PRETRAINED_DIR, folder)
        if not os.path.isfile(os.path.join(path, CONFIG)):
            continue
        config = load_config(path)
        if config.kind != kind:
            continue
        try:
            check_fits(config, fingerprint)
        except GateMismatchError:
            continue
        return path
    return None
