"""LoRA adapters: hooked while training, merged for inference, and the two agree."""

import pytest
import torch
from torch import nn

from vlm_kv.models.lora import (
    LoRASpec,
    attach_lora,
    detach_lora,
    grow_lora,
    load_lora_state,
    lora_state,
    merge_lora,
)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(8, 8, bias=False)
        self.v_proj = nn.Linear(8, 4, bias=True)
        self.mlp = nn.Linear(8, 8)

    def forward(self, x):
        return torch.cat([self.q_proj(x), self.v_proj(x), self.mlp(x)], -1)


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(Block(), Block())


SPEC = LoRASpec(rank=2, alpha=4.0, targets=("q_proj", "v_proj"))


def test_fresh_adapters_change_nothing_and_only_touch_targets():
    model, x = _model(), torch.randn(3, 8)
    before = model[0](x)
    adapters = attach_lora(model, SPEC)
    assert sorted(adapters) == ["0.q_proj", "0.v_proj", "1.q_proj", "1.v_proj"]
    torch.testing.assert_close(model[0](x), before)  # B starts at zero


def test_merged_weights_equal_the_hooked_path():
    trained, plain, x = _model(), _model(), torch.randn(5, 8)
    adapters = attach_lora(trained, SPEC)
    with torch.no_grad():
        for delta in adapters.values():
            delta.B.normal_()
    hooked = trained[1](trained[0](x)[..., :8])
    assert not torch.allclose(hooked, plain[1](plain[0](x)[..., :8]))  # the adapters matter
    assert merge_lora(plain, lora_state(adapters), SPEC) == 4
    torch.testing.assert_close(plain[1](plain[0](x)[..., :8]), hooked)
    detach_lora(trained, adapters)
    torch.testing.assert_close(trained[0](x), _model()[0](x))  # hooks gone: the plain layers again


def test_adapters_train_and_reload():
    model, x = _model(), torch.randn(4, 8)
    adapters = attach_lora(model, SPEC)
    params = [p for d in adapters.values() for p in (d.A, d.B)]
    opt = torch.optim.SGD(params, lr=0.1)
    loss = model[0](x).pow(2).sum()
    loss.backward()
    opt.step()
    assert any(d.B.abs().sum() > 0 for d in adapters.values())
    other = _model()
    again = attach_lora(other, SPEC)
    load_lora_state(again, lora_state(adapters))
    torch.testing.assert_close(other[0](x), model[0](x))


def test_fail_closed():
    model = _model()
    state = lora_state(attach_lora(model, SPEC))
    with pytest.raises(ValueError, match="already has a LoRA"):
        attach_lora(model, SPEC)
    with pytest.raises(ValueError, match="training adapter attached"):
        merge_lora(model, state, SPEC)
    plain = _model()
    partial = {k: v for k, v in state.items() if not k.startswith("1.")}
    with pytest.raises(ValueError, match="missing"):
        merge_lora(plain, partial, SPEC)
    with pytest.raises(ValueError, match="shapes"):
        merge_lora(plain, state, LoRASpec(rank=3, alpha=4.0, targets=SPEC.targets))
    with pytest.raises(ValueError, match="no nn.Linear"):
        attach_lora(plain, LoRASpec(targets=("k_proj",)))
    with pytest.raises(ValueError, match="rank"):
        LoRASpec(rank=0)
    assert LoRASpec.from_dict(SPEC.to_dict()) == SPEC


def test_grown_adapters_compute_what_the_smaller_ones_did():
    small, x = _model(), torch.randn(5, 8)
    adapters = attach_lora(small, SPEC)
    with torch.no_grad():
        for delta in adapters.values():
            delta.B.normal_()
    before = small[1](small[0](x)[..., :8])
    big_spec = LoRASpec(rank=3, alpha=9.0, targets=("q_proj", "v_proj", "mlp"))  # scale 3, not 2
    big = _model()
    grown = attach_lora(big, big_spec)
    grow_lora(grown, big_spec, lora_state(adapters), SPEC)
    torch.testing.assert_close(big[1](big[0](x)[..., :8]), before)
    assert grown["0.mlp"].B.abs().sum() == 0 and grown["0.q_proj"].B[:, 2:].abs().sum() == 0
    assert grown["0.q_proj"].A[2:].abs().sum() > 0  # the new rows can learn once B moves


def test_growing_refuses_what_would_change_the_model():
    state = lora_state(attach_lora(_model(), SPEC))
    for spec in (LoRASpec(rank=1, alpha=2.0, targets=SPEC.targets), LoRASpec(rank=2, alpha=4.0, targets=("q_proj",))):
        with pytest.raises(ValueError, match="cannot grow"):
            grow_lora(attach_lora(_model(), spec), spec, state, SPEC)
    partial = {k: v for k, v in state.items() if not k.startswith("1.")}
    with pytest.raises(ValueError, match="missing"):
        grow_lora(attach_lora(_model(), SPEC), SPEC, partial, SPEC)
