"""SegmentAttention recomputes a layer's attention for chosen queries exactly as the layer does."""

import pytest
import torch

from vlm_kv.train.image_attention import QueryTargets, SegmentAttention, image_targets


def _llama(layers=3):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    cfg._attn_implementation = "eager"
    return LlamaForCausalLM(cfg).eval()


def test_mass_equals_the_layers_attention_summed_per_segment():
    model = _llama()
    ids = torch.randint(0, 64, (2, 20))
    looks = SegmentAttention(model.model, [0, 2])
    with torch.no_grad():
        out = model(input_ids=ids, output_attentions=True)
    segs = torch.full((20,), -1)
    segs[2:7], segs[9:15] = 0, 1
    targets = QueryTargets(positions=torch.tensor([15, 19, 8]), segments=torch.tensor([0, 1, 0]),
                           key_segments=segs, n_segments=2)
    for layer in (0, 2):
        for row in (0, 1):
            with torch.no_grad():
                mass = looks.mass(layer, row, targets)  # [Q, H, S]
            att = out.attentions[layer][row]  # [H, T, T]
            for j, p in enumerate(targets.positions.tolist()):
                want = torch.stack([att[:, p, 2:7].sum(-1), att[:, p, 9:15].sum(-1)], -1)
                torch.testing.assert_close(mass[j], want, rtol=1e-5, atol=1e-6)
    looks.close()
    assert not looks.inputs
    with pytest.raises(RuntimeError, match="recorded nothing"):
        looks.mass(0, 0, targets)


def test_unknown_layer_is_refused():
    with pytest.raises(ValueError, match="out of range"):
        SegmentAttention(_llama(layers=2).model, [2])


def test_image_targets_find_each_answer_and_its_image():
    img, ign = 7, -100
    ids = torch.tensor([1, img, img, 2, img, img, 3, 4, 5, 6, 4, 8, 9])
    labels = torch.tensor([ign] * 7 + [5, 6] + [ign, ign] + [9, ign])
    t = image_targets(ids, labels, [1, 0], img, 2, ign)
    assert t.positions.tolist() == [6, 10] and t.segments.tolist() == [1, 0] and t.n_segments == 2
    assert t.key_segments.tolist() == [-1, 0, 0, -1, 1, 1] + [-1] * 7
    with pytest.raises(ValueError, match="answers in the labels"):
        image_targets(ids, labels, [1], img, 2, ign)
    with pytest.raises(ValueError, match="multiple of 3"):
        image_targets(ids, labels, [1, 0], img, 3, ign)
