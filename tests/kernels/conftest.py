import importlib
import os

import pytest
import torch

# Triton decides at decoration time whether a kernel is compiled or interpreted: without a GPU
# the kernels must be interpreted, so set this before anything imports our Triton module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def triton_kernels():
    """The Triton kernel module, interpreted on CPU (reloaded if something imported it compiled)."""
    pytest.importorskip("triton", reason="triton is not installed")
    module = importlib.import_module("vlm_kv.kernels.paged_triton")
    if DEVICE.type == "cpu" and not module.INTERPRETED:
        os.environ["TRITON_INTERPRET"] = "1"
        module = importlib.reload(module)
    assert DEVICE.type == "cuda" or module.INTERPRETED
    return module
