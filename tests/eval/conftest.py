import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models decode faster on one thread (and do not stall when the other core is busy)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
