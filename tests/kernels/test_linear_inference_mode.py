import pytest
import torch

from quire.kernels import cpu_extension

CPU_KERNELS = cpu_extension.load()


@pytest.mark.skipif(CPU_KERNELS is None, reason="Quire's C++ CPU kernels could not be built here")
def test_linear_bf16_gemm_path_works_in_and_out_of_inference_mode():
    """The float32 GEMM path (128+ rows) keeps buffers between calls: a first call under inference mode (as the
    engine runs) must not leave a later call outside it writing into an inference tensor."""
    x = torch.randn(200, 64).to(torch.bfloat16)
    weight = torch.randn(96, 64).to(torch.bfloat16)
    with torch.inference_mode():
        inside = CPU_KERNELS.linear_bf16(x, weight, None)
    outside = CPU_KERNELS.linear_bf16(x, weight, None)
    assert torch.equal(inside, outside)
