"""Where the Triton kernels run in these tests: on the GPU when the session has one, else (the usual case
in CI) on CPU tensors through Triton's interpreter, which tests/conftest.py turns on before any kernel
module is imported."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="session")
def device() -> str:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    if not torch.cuda.is_available():
        pytest.fail("TRITON_INTERPRET is off but there is no CUDA device: these tests cannot run here")
    return "cuda"


def assert_within_ulps(actual: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor | None = None,
                       ulps: float = 1.0) -> None:
    """Each element within ``ulps`` units in the last place of ``magnitude`` (default: the larger of the two
    values) in the tensors' dtype: the interpreter rounds float32 to bfloat16 by truncation, so bfloat16
    results may sit one unit away from PyTorch's round-to-nearest."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    actual32, expected32 = actual.float().cpu(), expected.float().cpu()
    if magnitude is None:
        magnitude = torch.maximum(actual32.abs(), expected32.abs())
    magnitude = magnitude.float().cpu().clamp_min(torch.finfo(actual.dtype).tiny)
    unit = torch.finfo(actual.dtype).eps * torch.exp2(torch.floor(torch.log2(magnitude)))
    error = (actual32 - expected32).abs()
    worst = (error / unit).max().item()
    assert worst <= ulps, f"{worst:.2f} units in the last place apart (allowed {ulps})"
