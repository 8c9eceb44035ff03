"""The Triton dequantize-matmul against the PyTorch reference, for every weight type it reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quire.kernels import quant
from quire.kernels.triton_ops.quant_linear import quant_linear

# N = 70 leaves a partial output tile; K = 512 is two K-quant super-blocks.
N, K = 70, 512


def random_weight(qtype: str, seed: int = 0) -> quant.QuantizedWeight:
    """A weight quantized from random floats (the gguf package's quantizers, or tests' for K-quants)."""
    rng = np.random.default_rng(seed)
    floats = rng.standard_normal((N, K)).astype(np.float32) * 0.5
    if qtype == "INT8":
        return quant.quantize_int8(torch.from_numpy(floats))
    import gguf

    from quire.core.testing.gguf_files import quantize_q4_k, quantize_q6_k

    if qtype == "Q4_K":
        raw = quantize_q4_k(floats)
    elif qtype == "Q6_K":
        raw = quantize_q6_k(floats)
    else:
        raw = gguf.quants.quantize(floats, gguf.GGMLQuantizationType[qtype])
    return quant.QuantizedWeight.from_gguf_bytes(qtype, torch.from_numpy(raw), N, K)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "INT8"])
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_matches_the_reference(qtype, rows, device):
    weight = random_weight(qtype)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(N, generator=torch.Generator().manual_seed(1))
    expected = quant.quant_linear_reference(x, weight, bias)
    scale = weight.scale.to(device) if weight.scale is not None else None
    actual = quant_linear(x.to(device), weight.qtype, weight.data.to(device), scale, N, K, bias.to(device))
    # float32 sums of K products in another order: a few units of float32 rounding of sum |x_k w_k|
    magnitude = x.abs() @ quant.dequantize_reference(weight).abs().T + bias.abs()
    assert (actual.cpu() - expected).abs().le(1e-5 * magnitude + 1e-6).all()


def test_refuses_an_unknown_type_and_a_ragged_width(device):
    weight = random_weight("Q8_0")
    x = torch.zeros(1, K, device=device)
    with pytest.raises(ValueError, match="no Triton kernel for weight type 'Q5_K'"):
        quant_linear(x, "Q5_K", weight.data.to(device), None, N, K)
    with pytest.raises(ValueError, match="multiple of 32"):
        quant_linear(x[:, :40], "Q8_0", weight.data.to(device), None, N, 40)
