import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models decode faster on one thread (and do not stall when the other core is busy)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_smollava(smollm2):
    """smollava's architecture around a tiny random language model with SmolLM2's tokenizer: the
    code paths of the visual tasks, fast (quality is measured on the real smollava)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from vlm_kv.models.smollava import build_smollava

    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                                      max_position_embeddings=4096, pad_token_id=2))
    return build_smollava(lm, smollm2[1])
