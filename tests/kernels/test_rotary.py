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


def phi3_config(**rope):
    from transformers import Phi3Config

    return Phi3Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=512,
                      original_max_position_embeddings=128, rope_parameters={"rope_theta": 10000.0, **rope})


@pytest.mark.parametrize("partial_rotary_factor", [1.0, 0.75])
def test_longrope_inverse_frequencies_match_transformers(partial_rotary_factor):
    num_factors = int(16 * partial_rotary_factor) // 2
    short, long = [1.0 + 0.3 * i for i in range(num_factors)], [1.0 + 2.5 * i for i in range(num_factors)]
    config = phi3_config(rope_type="longrope", short_factor=short, long_factor=long,
                         partial_rotary_factor=partial_rotary_factor)
    for max_positions, seq_len in ((128, None), (129, 129)):  # within the original context, and beyond it
        expected, _ = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=seq_len)
        actual = rope_inv_freq(2 * num_factors, 10000.0, "longrope", original_max_position_embeddings=128,
                               short_factor=short, long_factor=long, max_positions=max_positions)
        torch.testing.assert_close(actual, expected.float(), rtol=0, atol=0)
        assert not torch.allclose(actual, rope_inv_freq(2 * num_factors, 10000.0))


def test_longrope_needs_a_factor_per_frequency():
    with pytest.raises(ValueError, match="8 factors"):
        rope_inv_freq(16, 1e4, "longrope", short_factor=[1.0] * 7, long_factor=[1.0] * 8)


def test_attention_factor_scales_the_table():
    inv_freq = rope_inv_freq(16, 1e4)
    torch.testing.assert_close(rope_cos_sin(inv_freq, 20, 1.5), rope_cos_sin(inv_freq, 20) * 1.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rotary_matches_transformers(dtype):
    """A table for 12 of 16 head dimensions (Phi-4-mini's 0.75) rotates those and passes the rest through."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply_rotary_pos_emb

    torch.manual_seed(5)
    inv_freq = rope_inv_freq(12, 10000.0)
    positions = torch.tensor([0, 3, 7, 49, 12, 30])
    qkv = torch.randn(6, (4 + 2 + 2) * 16).to(dtype)
    q, k = qkv[:, :64].view(6, 4, 16), qkv[:, 64:96].view(6, 2, 16)  # strided views, as in the model
    q_out, k_out = rotate(q, k, *rotary_factors(positions, rope_cos_sin(inv_freq, 50), dtype))
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos()[None].to(dtype), emb.sin()[None].to(dtype)
    q_ref, k_ref = phi3_apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    # the CPU kernel's float32 products may differ in the last bit (as in the whole-head test above)
    tolerance = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=0, atol=0)
    torch.testing.assert_close(q_out, q_ref[0].transpose(0, 1), **tolerance)
    torch.testing.assert_close(k_out, k_ref[0].transpose(0, 1), **tolerance)
    torch.testing.assert_close(q_out[..., 12:], q[..., 12:], rtol=0, atol=0)
