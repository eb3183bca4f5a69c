"""Learned retention gates (TrimKV / DBTrimKV): modules, saving, hooks, shipped defaults."""

from __future__ import annotations

import os

PRETRAINED_DIR = os.path.join(os.path.dirname(__file__), "pretrained")
DEFAULTS = {"smollm2-135m": "smollm2-135m-dbtrimkv"}


def default_gates_for(model) -> str | None:
    """Folder of the gates shipped for ``model`` (matched by structure), or None."""
    from vlm_kv.gates.io import CONFIG, GateMismatchError, check_fits, load_config

    for folder in DEFAULTS.values():
        path = os.path.join(PRETRAINED_DIR, folder)
        if not os.path.isfile(os.path.join(path, CONFIG)):
            continue
        try:
            check_fits(load_config(path), model)
        except GateMismatchError:
            continue
        return path
    return None
