"""RetentionGates: the inference path of log_beta computes what the trained path computes."""
import pytest
import torch

from vlm_kv.testing import tiny_gates, tiny_model


@pytest.mark.parametrize("kind", ["dbtrimkv", "trimkv"])
def test_log_beta_without_grad_equals_the_training_path(kind):
    model = tiny_model("llama", num_layers=3)
    gates = tiny_gates(model, kind=kind)
    hidden = torch.randn(2, 7, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for layer in range(3):
        trained = gates.log_beta(layer, hidden)  # grad enabled: the module path
        assert trained.requires_grad
        with torch.no_grad():
            fast = gates.log_beta(layer, hidden)
        assert fast.shape == (2, model.config.num_key_value_heads, 7)
        assert torch.equal(fast, trained.detach())
