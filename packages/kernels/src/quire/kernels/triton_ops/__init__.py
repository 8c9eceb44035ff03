"""Quire's Triton kernels: the GPU path of every op in ``quire.kernels``.

Modules: ``elementwise`` (RMSNorm with the residual add, rotary, SiLU-and-multiply, the KV-cache write),
``attention`` (paged attention for decodes and for prompt chunks over a cached prefix) and ``quant_linear``
(the dequantize-matmul of quantized weights). Each kernel
has one launcher, checked against the PyTorch reference of the same op.

The public functions of ``quire.kernels`` call these launchers only for CUDA tensors. A launcher given CPU
tensors refuses to run unless Triton's interpreter is on (``TRITON_INTERPRET=1``, set before this package
is imported), which is how the tests run every kernel on machines without a GPU.
"""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """Whether Triton's interpreter (not a GPU) runs the kernels in this process."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(*tensors: torch.Tensor) -> None:
    """Refuse tensors a compiled Triton kernel cannot read: they must share one CUDA device, or the
    interpreter must be on."""
    if interpreting():
        return
    devices = {t.device for t in tensors}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ValueError(f"Triton kernels need tensors on one CUDA device, got {sorted(map(str, devices))}")


def upcast_dots(dtype: torch.dtype) -> bool:
    # NOTE: the interpreter's bfloat16 tl.dot gives wrong results (upstream bug), so under the interpreter
    # bfloat16 dot operands are upcast to float32; on GPUs they stay in bfloat16 for the tensor cores.
    return interpreting() and dtype == torch.bfloat16


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
