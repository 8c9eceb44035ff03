"""Triton dequantize-matmul: ``x @ W.T`` with ``W`` in GGUF blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) or INT8.

Each program computes a ``[BLOCK_M, BLOCK_N]`` tile of the output. It walks K in groups of 32 weights (a
block of the 32-wide types, a sub-block of the K-quants' 256-wide super-blocks): for every weight of the
group it reads the byte that holds its bits, widens the ``[BLOCK_N, 32]`` tile to float32 in registers with
its scale (and minimum), and accumulates ``tl.dot`` of the activations' ``[BLOCK_M, 32]`` tile against it
in float32. The raw weight rows are read as bytes, so one kernel covers every layout; each type is a few
lines of index arithmetic (``_dequantize_group``), written from the same definitions as
``quire.kernels.quant.dequantize_reference``, the oracle the tests compare with.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quire.kernels.triton_ops import check_device

# Type codes the kernel branches on (constexpr).
_CODES = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "Q4_K": 3, "Q6_K": 4, "INT8": 5}
GROUP = 32


@triton.jit
def _fp16_at(row_ptr, offset, mask):
    lo = tl.load(row_ptr + offset, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(row_ptr + offset + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dequantize_group(w_ptr, scale_ptr, rows, row_bytes, group, mask, QTYPE: tl.constexpr):
    """float32 ``[BLOCK_N, 32]``: weights ``32 * group ... 32 * group + 31`` of ``rows``."""
    lane = tl.arange(0, 32)[None, :]
    row_ptr = w_ptr + rows.to(tl.int64)[:, None] * row_bytes
    mask2 = mask[:, None]
    if QTYPE == 5:  # INT8: int8 [N, K], one float32 scale per row
        q = tl.load(row_ptr + group * 32 + lane, mask=mask2, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        scale = tl.load(scale_ptr + rows, mask=mask, other=0.0)
        w = q * scale[:, None]
    elif QTYPE == 0:  # Q8_0: fp16 d, 32 int8
        block = row_ptr + group * 34
        d = _fp16_at(block, 0, mask2)
        q = tl.load(block + 2 + lane, mask=mask2, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = d * q
    elif QTYPE == 1:  # Q4_0: fp16 d, 16 bytes of nibbles (low: weights 0-15, high: 16-31)
        block = row_ptr + group * 18
        d = _fp16_at(block, 0, mask2)
        byte = tl.load(block + 2 + (lane % 16), mask=mask2, other=0).to(tl.int32)
        w = d * (((byte >> ((lane // 16) * 4)) & 15).to(tl.float32) - 8.0)
    elif QTYPE == 2:  # Q4_1: fp16 d, fp16 m, 16 bytes of nibbles
        block = row_ptr + group * 20
        d = _fp16_at(block, 0, mask2)
        byte = tl.load(block + 4 + (lane % 16), mask=mask2, other=0).to(tl.int32)
        w = d * ((byte >> ((lane // 16) * 4)) & 15).to(tl.float32) + _fp16_at(block, 2, mask2)
    elif QTYPE == 3:  # Q4_K: fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
        block = row_ptr + (group // 8) * 144
        j = group % 8
        d = _fp16_at(block, 0, mask2)
        dmin = _fp16_at(block, 2, mask2)
        s_j = tl.load(block + 4 + j, mask=mask2, other=0).to(tl.int32)
        s_j4 = tl.load(block + 8 + j, mask=mask2, other=0).to(tl.int32)
        s_jm4 = tl.load(block + 4 + tl.maximum(j - 4, 0), mask=mask2, other=0).to(tl.int32)
        low = j < 4
        sc = tl.where(low, s_j & 63, (s_j4 & 15) | ((s_jm4 >> 6) << 4))
        mn = tl.where(low, s_j4 & 63, (s_j4 >> 4) | ((s_j >> 6) << 4))
        byte = tl.load(block + 16 + (j // 2) * 32 + lane, mask=mask2, other=0).to(tl.int32)
        q = ((byte >> ((j % 2) * 4)) & 15).to(tl.float32)
        w = d * sc.to(tl.float32) * q - dmin * mn.to(tl.float32)
    else:  # Q6_K: ql[128], qh[64], int8 scales[16], fp16 d; element e of the super-block
        block = row_ptr + (group // 8) * 210
        e = (group % 8) * 32 + lane
        half = e // 128
        r = e % 128
        g = r // 32
        lane_in_quarter = r % 32
        ql = tl.load(block + 64 * half + lane_in_quarter + 32 * (g % 2), mask=mask2, other=0).to(tl.int32)
        qh = tl.load(block + 128 + 32 * half + lane_in_quarter, mask=mask2, other=0).to(tl.int32)
        q = ((ql >> (4 * (g // 2))) & 15) | (((qh >> (2 * g)) & 3) << 4)
        scale = tl.load(block + 192 + e // 16, mask=mask2, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        d = _fp16_at(block, 208, mask2)
        w = d * scale * (q.to(tl.float32) - 32.0)
    return w


@triton.jit
def _quant_linear_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, row_bytes, stride_x, stride_out,
                         QTYPE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = rows_m < M
    mask_n = rows_n < N
    lane = tl.arange(0, 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for group in range(0, K // 32):
        x = tl.load(x_ptr + rows_m.to(tl.int64)[:, None] * stride_x + group * 32 + lane[None, :],
                    mask=mask_m[:, None], other=0.0).to(tl.float32)
        w = _dequantize_group(w_ptr, scale_ptr, rows_n, row_bytes, group, mask_n, QTYPE)
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows_m.to(tl.int64)[:, None] * stride_out + rows_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def quant_linear(x: torch.Tensor, qtype: str, data: torch.Tensor, scale: torch.Tensor | None, out_features: int,
                 in_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` in ``x``'s dtype for a 2-D ``x`` and a weight in raw blocks (``data``: uint8 rows,
    or int8 ``[N, K]`` with a float32 ``scale`` per row for INT8), accumulated in float32."""
    if qtype not in _CODES:
        raise ValueError(f"no Triton kernel for weight type {qtype!r}; types: {', '.join(_CODES)}")
    if in_features % GROUP:
        raise ValueError(f"in_features must be a multiple of {GROUP}, got {in_features}")
    check_device(x, data, *([bias] if bias is not None else []))
    x = x.contiguous()
    m = x.shape[0]
    out = torch.empty(m, out_features, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(out_features, block_n))
    _quant_linear_kernel[grid](
        x, data, scale if scale is not None else data, bias if bias is not None else x, out,
        m, out_features, in_features, data.stride(0) * data.element_size(), x.stride(0), out.stride(0),
        QTYPE=_CODES[qtype], HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
    )
    return out
