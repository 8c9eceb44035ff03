import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from quire.kernels.rotary import (
    rope_cos_sin,
    rope_inv_freq,
    rotary_factors,
    rotate,
    rotate_reference,
)

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64, "rope_theta": 500000.0}


def test_llama3_inverse_frequencies_match_transformers():
    config = LlamaConfig(hidden_size=256, num_attention_heads=2, rope_parameters=dict(LLAMA3))
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    actual = rope_inv_freq(128, 500000.0, "llama3", 8.0, 1.0, 4.0, 64)
    torch.testing.assert_close(actual, expected.float())
    # the scaling changed something, or this comparison would prove little
    assert not torch.allclose(actual, rope_inv_freq(128, 500000.0))


def test_linear_scaling_divides_frequencies():
    torch.testing.assert_close(rope_inv_freq(16, 1e4, "linear", factor=2.0), rope_inv_freq(16, 1e4) / 2)


def test_unknown_rope_type_is_refused():
    with pytest.raises(NotImplementedError, match="yarn"):
        rope_inv_freq(16, 1e4, "yarn")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_reference_matches_transformers(dtype):
    torch.manual_seed(0)
    head_dim, max_pos = 32, 50
    inv_freq = rope_inv_freq(head_dim, 10000.0)
    table = rope_cos_sin(inv_freq, max_pos)
    positions = torch.tensor([0, 3, 7, 49, 12])
    q = torch.randn(5, 4, head_dim, dtype=dtype)
    k = torch.randn(5, 2, head_dim, dtype=dtype)
    q_out, k_out = rotate_reference(q, k, *rotary_factors(positions, table, dtype))
    # transformers' layout: [batch, heads, seq, dim] with cos/sin [batch, seq, dim]
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos()[None].to(dtype), emb.sin()[None].to(dtype)
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(q_out, q_ref[0].transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(k_out, k_ref[0].transpose(0, 1), rtol=0, atol=0)


@pytest.mark.parametrize("tokens", [21, 300])  # one thread, and tokens split over threads (~32K elements each)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_rotary_matches_the_reference(dtype, tokens):
    torch.manual_seed(4)
    table = rope_cos_sin(rope_inv_freq(64, 10000.0), 300)
    positions = torch.randint(0, 300, (tokens,))
    qkv = torch.randn(tokens, (8 + 2 + 2) * 64).to(dtype)
    q, k = qkv[:, :512].view(tokens, 8, 64), qkv[:, 512:640].view(tokens, 2, 64)  # strided views, as in the model
    factors = rotary_factors(positions, table, dtype)
    tolerance = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=0, atol=0)
    for got, expected in zip(rotate(q, k, *factors), rotate_reference(q, k, *factors)):
        torch.testing.assert_close(got, expected, **tolerance)
