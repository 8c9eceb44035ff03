"""Weights kept quantized in memory (GGUF's block formats and Quire's INT8), and the linear layers and
embedding lookups that compute on them.

A ``QuantizedWeight`` of shape ``[out_features, in_features]`` holds, for the GGUF types, the file's own bytes:
a contiguous ``uint8`` tensor ``[N, K / block_size * type_size]``, each row its blocks in order
(``csrc/quant_blocks.h`` draws every layout). ``INT8`` (``--quantization int8`` on ordinary checkpoints)
is an ``int8`` tensor ``[N, K]`` with one float32 scale per row.

``dequantize`` and ``quant_linear`` run Quire's C++ kernels when the CPU extension is built (AVX-512, AVX2
or portable C++, whichever is the widest the CPU has); ``quant_linear`` on CUDA tensors runs the Triton
dequantize-matmul (``triton_ops/quant_linear.py``); otherwise their ``*_reference`` twins in PyTorch ops. Their
keyword ``isa`` (``"avx512"``, ``"avx2"``, ``"scalar"``) forces a narrower path of the C++ kernels: tests use
it to cover the AVX2 path on AVX-512 machines. Importing this module builds nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from quire.kernels import cpu_extension

# name -> (elements per block, bytes per block); INT8's per-row scales are stored apart from its bytes
QUANT_TYPES: dict[str, tuple[int, int]] = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q6_K": (256, 210),
    "INT8": (1, 1),
}
# the GGUF types, by their ggml type id in GGUF tensor headers
GGML_TYPE_IDS: dict[str, int] = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A linear layer's weight ``[out_features, in_features]`` in a quantized format (see the module's doc).

    Rows are independent: ``rows()`` slices them without copying and ``concat_rows()`` stacks weights of one
    type (fused projections)."""

    qtype: str
    data: torch.Tensor  # uint8 [N, row bytes] (GGUF types) or int8 [N, K] (INT8)
    scale: torch.Tensor | None  # float32 [N] for INT8, else None
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        """Bytes a forward pass reads: the data and the scales."""
        scale_bytes = 0 if self.scale is None else self.scale.numel() * self.scale.element_size()
        return self.data.numel() * self.data.element_size() + scale_bytes

    def rows(self, start: int, stop: int) -> QuantizedWeight:
        """Output rows ``[start, stop)`` (views of this weight's tensors)."""
        if not 0 <= start <= stop <= self.out_features:
            raise ValueError(f"rows({start}, {stop}): out of range for {self.out_features} output rows")
        scale = None if self.scale is None else self.scale[start:stop]
        return QuantizedWeight(self.qtype, self.data[start:stop], scale, stop - start, self.in_features)

    @classmethod
    def concat_rows(cls, weights: Sequence[QuantizedWeight]) -> QuantizedWeight:
        """The weights stacked along their output rows; they must share type and ``in_features``."""
        first = weights[0]
        for weight in weights[1:]:
            if (weight.qtype, weight.in_features) != (first.qtype, first.in_features):
                raise ValueError(f"concat_rows: a {weight.qtype} weight with {weight.in_features} inputs does not "
                                 f"stack with a {first.qtype} weight with {first.in_features}")
        scale = None if first.scale is None else torch.cat([weight.scale for weight in weights])
        data = torch.cat([weight.data for weight in weights])
        return cls(first.qtype, data, scale, sum(weight.out_features for weight in weights), first.in_features)

    @classmethod
    def from_gguf_bytes(cls, qtype: str, raw: torch.Tensor, out_features: int, in_features: int) -> QuantizedWeight:
        """A weight from a GGUF tensor's bytes (uint8, ``[out_features, row bytes]`` or flat), kept as they are
        (a view when ``raw`` is contiguous). Raises ValueError naming what does not fit."""
        if qtype not in GGML_TYPE_IDS:
            raise ValueError(f"qtype: {qtype!r} is not a supported GGUF type ({', '.join(GGML_TYPE_IDS)})")
        block_size, type_size = QUANT_TYPES[qtype]
        if in_features <= 0 or in_features % block_size != 0:
            raise ValueError(f"in_features: {in_features} is not a positive multiple of {qtype}'s block size "
                             f"{block_size}")
        if raw.dtype != torch.uint8:
            raise ValueError(f"raw: the bytes must be a uint8 tensor, not {raw.dtype}")
        row_bytes = in_features // block_size * type_size
        if raw.numel() != out_features * row_bytes or (raw.dim() == 2 and raw.shape[1] != row_bytes):
            raise ValueError(f"raw: {tuple(raw.shape)} bytes do not hold a {qtype} weight of "
                             f"[{out_features}, {in_features}] ({out_features} rows of {row_bytes} bytes)")
        return cls(qtype, raw.reshape(out_features, row_bytes).contiguous(), None, out_features, in_features)


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Quire's INT8 form of a float weight ``[N, K]``: symmetric per output row, ``scale = max|row| / 127``,
    ``q = round(w / scale)`` (to nearest, ties to even); ``|w - q * scale| <= scale / 2``."""
    weight = weight.detach().float()
    scale = weight.abs().amax(dim=1) / 127
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(weight / divisor[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight("INT8", q.contiguous(), scale.contiguous(), weight.shape[0], weight.shape[1])


def quant_kernel_isa(isa: str | None = None) -> str:
    """The path ``quant_linear`` and ``dequantize`` take here: ``"avx512"``, ``"avx2"``, ``"scalar"`` (the C++
    kernels) or ``"torch"`` (the references); with ``isa``, whether that C++ path runs (raises if it cannot)."""
    kernels = cpu_extension.load()
    if kernels is None:
        if isa is not None:
            raise RuntimeError(f"isa={isa!r}: Quire's C++ CPU kernels are not available here")
        return "torch"
    return kernels.quant_isa(isa or "")


def dequantize(weight: QuantizedWeight, rows: torch.Tensor | None = None, *, isa: str | None = None) -> torch.Tensor:
    """The float32 weight ``[N, K]``, or only the ``rows`` it names (an index tensor of any shape: the result is
    ``rows.shape + (K,)``, an embedding lookup in a quantized table)."""
    kernels = _kernels(weight, isa)
    if kernels is None:
        selected = weight if rows is None else _select_rows(weight, rows.reshape(-1))
        out = dequantize_reference(selected)
    else:
        out = kernels.quant_dequantize(weight.data, weight.scale, weight.qtype, rows, isa or "")
    return out if rows is None else out.reshape(*rows.shape, weight.in_features)


def quant_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None, *,
                 isa: str | None = None) -> torch.Tensor:
    """``x @ w.T + bias`` for a 2-D float32 or bfloat16 ``x``, accumulated in float32, in ``x``'s dtype."""
    if x.is_cuda:  # the Triton dequantize-matmul
        from quire.kernels.triton_ops.quant_linear import quant_linear as triton_quant_linear

        return triton_quant_linear(x, weight.qtype, weight.data, weight.scale, weight.out_features,
                                   weight.in_features, bias)
    kernels = _kernels(weight, isa) if x.is_cpu and x.dtype in (torch.float32, torch.bfloat16) else None
    if kernels is None:
        return quant_linear_reference(x, weight, bias)
    return kernels.quant_linear(x.contiguous(), weight.data, weight.scale, weight.qtype, bias, isa or "")


def quant_linear_reference(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``quant_linear`` in PyTorch ops: a float32 matrix multiply with the dequantized weight."""
    out = x.float() @ dequantize_reference(weight).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def dequantize_reference(weight: QuantizedWeight) -> torch.Tensor:
    """The float32 weight ``[N, K]`` in PyTorch ops; every value equals gguf-py's (and ggml's) bit for bit:
    the products of fp16 scales and small integers are exact in float32."""
    if weight.qtype == "INT8":
        return weight.data.float() * weight.scale[:, None]
    type_size = QUANT_TYPES[weight.qtype][1]
    blocks = weight.data.reshape(-1, type_size)
    values = _BLOCK_DECODERS[weight.qtype](blocks)
    return values.reshape(weight.out_features, weight.in_features)


def _kernels(weight: QuantizedWeight, isa: str | None):
    kernels = cpu_extension.load() if weight.data.is_cpu else None
    if kernels is None and isa is not None:
        raise RuntimeError(f"isa={isa!r}: Quire's C++ CPU kernels are not available here")
    return kernels


def _select_rows(weight: QuantizedWeight, rows: torch.Tensor) -> QuantizedWeight:
    scale = None if weight.scale is None else weight.scale[rows]
    return QuantizedWeight(weight.qtype, weight.data[rows], scale, rows.numel(), weight.in_features)


def _fp16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at byte ``offset`` of each block, as float32 ``[num_blocks, 1]``."""
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Bytes ``[..., n]`` -> ``[..., 2n]``: the low nibbles, then the high ones."""
    return torch.cat([packed & 15, packed >> 4], dim=-1)


def _decode_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return _fp16(blocks, 0) * blocks[:, 2:].contiguous().view(torch.int8).float()


def _decode_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return _fp16(blocks, 0) * (_nibbles(blocks[:, 2:]).float() - 8)


def _decode_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return _fp16(blocks, 0) * _nibbles(blocks[:, 4:]).float() + _fp16(blocks, 2)


def _decode_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # scales: bytes 0-3 hold the low 6 bits of scales 0-3 (and in bits 6-7 the high bits of scales 4-7),
    # bytes 4-7 the same for the mins, bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high)
    packed = blocks[:, 4:16]
    first, second, low = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([first & 63, (low & 15) | ((first >> 6) << 4)], dim=-1).float()
    mins = torch.cat([second & 63, (low >> 4) | ((second >> 6) << 4)], dim=-1).float()
    # 4 groups of 32 bytes: the low nibbles are one sub-block of 32, the high nibbles the next
    q = _nibbles(blocks[:, 16:].reshape(-1, 4, 32)).reshape(-1, 8, 32).float()
    d, dmin = _fp16(blocks, 0), _fp16(blocks, 2)
    return ((d * scales)[..., None] * q - (dmin * mins)[..., None]).reshape(-1, 256)


def _decode_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # two halves of 128: low 4 bits from 64 bytes of ql (low nibbles, then high), high 2 bits from 32 bytes of
    # qh (bits 0-1, 2-3, 4-5, 6-7: four runs of 32)
    ql = _nibbles(blocks[:, :128].reshape(-1, 2, 64))
    qh_bytes = blocks[:, 128:192].reshape(-1, 2, 32)
    qh = torch.cat([(qh_bytes >> shift) & 3 for shift in (0, 2, 4, 6)], dim=-1)
    q = ((ql | (qh << 4)).float() - 32).reshape(-1, 16, 16)
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    return ((_fp16(blocks, 208) * scales)[..., None] * q).reshape(-1, 256)


_BLOCK_DECODERS = {"Q8_0": _decode_q8_0, "Q4_0": _decode_q4_0, "Q4_1": _decode_q4_1, "Q4_K": _decode_q4_k,
                   "Q6_K": _decode_q6_k}
