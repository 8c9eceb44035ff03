"""Matrix multiply entry points for linear layers.

On CPUs, bfloat16 linear layers take the fastest path the machine has, chosen once per process:

- ``onednn``: oneDNN runs them from a weight reordered once into its blocked layout (``prepack``),
  noticeably faster than ``F.linear`` (about 1.5x on decode-sized batches); that is the op
  ``torch.compile`` emits for CPU linears with frozen weights. It needs AVX-512 (or AVX-NE-CONVERT).
- ``kernel``: on AVX2 CPUs without it, PyTorch's own bfloat16 matrix multiply is a generic loop (about
  16 GFLOP/s on two cores); Quire's C++ kernel (``csrc/linear_bf16.cpp``) widens the bfloat16 weights to
  float32 in registers and accumulates in float32 with FMA instead.
- ``torch``: ``F.linear`` (no compiler for the C++ kernels, or ``QUIRE_CPU_KERNELS=0``).

Other dtypes and devices always use ``F.linear``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

# The batch size oneDNN is told to expect; one blocked layout serves 1 to several thousand rows well.
_PACK_BATCH_HINT = 512

PackedLinear = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def can_prepack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and bf16_path() != "torch"


@functools.cache
def bf16_path() -> str:
    """How this process runs bfloat16 linear layers on the CPU: ``onednn``, ``kernel`` or ``torch``."""
    mkldnn = torch.ops.mkldnn
    if (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_linear_pointwise")
            and hasattr(mkldnn, "_is_mkldnn_bf16_supported") and mkldnn._is_mkldnn_bf16_supported()):
        return "onednn"
    from quire.kernels import cpu_extension

    kernels = cpu_extension.load()
    return "kernel" if kernels is not None and kernels.linear_bf16_vectorized() else "torch"


@functools.cache
def amx_matmul() -> bool:
    """Whether oneDNN multiplies this process's bfloat16 linear layers on AMX tiles (the ``onednn`` path on a
    CPU with AMX)."""
    supported = getattr(torch.cpu, "_is_amx_tile_supported", None)  # private: absent, AMX is not assumed
    return bf16_path() == "onednn" and supported is not None and bool(supported())


@functools.cache
def native_bf16_matmul() -> bool:
    """Whether oneDNN multiplies this process's bfloat16 linear layers with the CPU's own bfloat16 instructions
    (the ``onednn`` path on a CPU with AMX tiles or AVX-512 BF16, not oneDNN's float32 emulation): there its
    kernels want many rows at once (``quire.core.models.llama.cpu_mlp_chunk_rows``)."""
    if amx_matmul():
        return True
    supported = getattr(torch.cpu, "_is_avx512_bf16_supported", None)  # private: absent, not assumed
    return bf16_path() == "onednn" and supported is not None and bool(supported())


def prepack(weight: torch.Tensor) -> PackedLinear:
    """``(x, bias) -> x @ weight.T + bias`` from ``weight`` (``[out, in]``) prepared once for this CPU's
    fastest bfloat16 path (only when ``can_prepack(weight)``)."""
    if bf16_path() == "onednn":
        return OneDNNLinear(torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT))
    return KernelLinear(weight)


class KernelLinear:
    """A bfloat16 weight run through Quire's C++ kernel (the ``kernel`` path); ``weight`` is the plain
    ``[out, in]`` tensor, which fused C++ paths (``quire.kernels.decode_stack``) read directly."""

    def __init__(self, weight: torch.Tensor):
        from quire.kernels import cpu_extension

        self.weight = weight.contiguous()
        self._kernel = cpu_extension.load().linear_bf16

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._kernel(x, self.weight, bias)


class OneDNNLinear:
    """A weight in oneDNN's blocked layout (the ``onednn`` path); oneDNN can also apply GELU or add another
    tensor in the multiply's epilogue, before the result is rounded to bfloat16.

    A few rows (decode steps: up to 8; 128 with AMX; 64 where oneDNN packs 64-wide blocks, AMD Zen 4) go to
    Quire's ``onednn_gemv`` kernel on the same packed weight when it can read its layout (``gemv_rows``: how
    many; 0 when it cannot): oneDNN's fixed cost per call is a quarter of a small layer's time there, and from
    9 rows on Zen 4 its kernels wait on memory for the weight. The C++ decoder stack makes the same choice, so
    both compute the same bits."""

    def __init__(self, packed: torch.Tensor):
        from quire.kernels import cpu_extension

        self.packed = packed
        kernels = cpu_extension.load()
        self.gemv_rows = (kernels.onednn_gemv_max_rows()
                          if kernels is not None and kernels.onednn_gemv_layout(packed) else 0)
        self._gemv = kernels.onednn_gemv if self.gemv_rows else None

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= self.gemv_rows:
            return self._gemv(x, self.packed, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    def gelu(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "gelu", [], "none")  # "none": erf GELU

    def add(self, x: torch.Tensor, bias: torch.Tensor | None, other: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.packed, bias, "add")


def linear_gelu(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None = None,
                packed: PackedLinear | None = None) -> torch.Tensor:
    """``gelu(x @ weight.T + bias)`` (exact, erf GELU), fused into the multiply on the ``onednn`` path."""
    if isinstance(packed, OneDNNLinear):
        return packed.gelu(x, bias)
    return F.gelu(linear(x, weight, bias, packed))


def linear_add(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, other: torch.Tensor,
               packed: PackedLinear | None = None) -> torch.Tensor:
    """``x @ weight.T + bias + other`` (a residual), fused into the multiply on the ``onednn`` path."""
    if isinstance(packed, OneDNNLinear):
        return packed.add(x, bias, other)
    return linear(x, weight, bias, packed) + other


def linear(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None = None,
           packed: PackedLinear | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for a 2-D ``x``, through the prepacked form when there is one."""
    if packed is not None:
        return packed(x, bias)
    return F.linear(x, weight, bias)
