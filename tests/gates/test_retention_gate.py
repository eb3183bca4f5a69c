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


@pytest.mark.parametrize("kind,coupled", [("dbtrimkv", True), ("dbtrimkv", False), ("trimkv", True)])
def test_all_layers_at_once_equal_each_layer_alone(kind, coupled):
    model = tiny_model("llama", num_layers=3)
    gates = tiny_gates(model, kind=kind, coupled=coupled)  # rates far apart: a mixed-up layer or head shows
    hidden = torch.randn(3, 2, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    stacked = gates.log_beta_stacked(hidden)
    assert stacked.shape == (3, 2, model.config.num_key_value_heads)
    with torch.no_grad():
        for layer in range(3):
            alone = gates.log_beta(layer, hidden[layer][:, None])[..., 0]
            torch.testing.assert_close(stacked[layer], alone, rtol=1e-5, atol=1e-5)
    # the stacked weights follow a parameter change (an optimizer step between two generations)
    with torch.no_grad():
        gates.trunks[1].net[0].bias.add_(0.5)
        alone = gates.log_beta(1, hidden[1][:, None])[..., 0]
    torch.testing.assert_close(gates.log_beta_stacked(hidden)[1], alone, rtol=1e-5, atol=1e-5)


def test_stacked_gates_follow_a_state_dict_loaded_by_assignment_and_a_dtype_change():
    model = tiny_model("llama", num_layers=3)
    gates, other = tiny_gates(model, seed=0), tiny_gates(model, seed=1)
    hidden = torch.randn(3, 2, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    before = gates.log_beta_stacked(hidden)
    gates.load_state_dict(other.state_dict(), assign=True)  # new parameter objects, not an in-place change
    after = gates.log_beta_stacked(hidden)
    torch.testing.assert_close(after, other.log_beta_stacked(hidden))
    assert not torch.allclose(before, after)
    gates.double()
    assert gates.log_beta_stacked(hidden.double()).dtype == torch.float32
    torch.testing.assert_close(gates.log_beta_stacked(hidden.double()), after, rtol=1e-5, atol=1e-5)
