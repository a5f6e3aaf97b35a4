"""The llama.cpp figure's checkpoint: a Qwen3-Next model saved as Qwen3.5 computes the same."""

from flashrt_ros.bench.peer import qwen35_checkpoint
import pytest
import torch
import transformers


@pytest.mark.parametrize('tied', [False, True])
def test_the_qwen3_5_checkpoint_gives_the_same_logits(tmp_path, tied):
    config = transformers.Qwen3NextConfig(
        vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        head_dim=16, num_attention_heads=4, num_key_value_heads=2,
        layer_types=['linear_attention'] * 3 + ['full_attention'], mlp_only_layers=[0, 1, 2, 3],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=tied,
        initializer_range=0.2)
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(config).eval()
    out = qwen35_checkpoint(model, tmp_path / 'qwen35')
    other = transformers.Qwen3_5ForCausalLM.from_pretrained(str(out)).eval()
    assert other.config.tie_word_embeddings == tied
    assert (other.lm_head.weight is other.model.embed_tokens.weight) == tied
    ids = torch.tensor([[5, 200, 17, 99, 3, 250, 64, 1]])
    with torch.no_grad():
        a, b = model(ids).logits, other(ids).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
