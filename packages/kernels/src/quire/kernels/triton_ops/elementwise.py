"""Row-wise Triton kernels: RMSNorm (with the residual add), rotary, SiLU-and-multiply, the KV-cache write.

Each reproduces the rounding points of its PyTorch reference: arithmetic in float32, rounded to the
activations' dtype wherever the reference holds an intermediate in that dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quire.kernels.triton_ops import check_device, next_power_of_2


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr,
                     stride_x, stride_residual, stride_out, stride_sum, num_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) / num_cols
    normed = (x32 * (1.0 / tl.sqrt(variance + eps))).to(out_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(rms_norm(x + residual), x + residual)``; without a residual ``(rms_norm(x), None)``."""
    check_device(x, weight, *([residual] if residual is not None else []))
    num_cols = x.shape[-1]
    x2 = x.reshape(-1, num_cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    summed = residual2 = None
    if residual is not None:
        residual2 = residual.reshape(-1, num_cols).contiguous()
        summed = torch.empty_like(out)
    block = next_power_of_2(num_cols)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, residual2 if residual2 is not None else x2, weight, out, summed if summed is not None else out,
        x2.stride(0), residual2.stride(0) if residual2 is not None else 0, out.stride(0),
        summed.stride(0) if summed is not None else 0, num_cols, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_row_warps(block),
    )
    return out.view(x.shape), (summed.view(x.shape) if summed is not None else None)


@triton.jit
def _rotate_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, stride_x_token, stride_x_head, stride_out_token,
                   stride_out_head, stride_factor, num_heads,
                   HALF: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < HALF)
    x_first = x_ptr + token * stride_x_token + heads * stride_x_head + dims
    x1 = tl.load(x_first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_first + HALF, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + token * stride_factor + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_factor + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    # each product is rounded to the activations' dtype before the sum, as the reference does
    first = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    second = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    out_first = out_ptr + token * stride_out_token + heads * stride_out_head + dims
    tl.store(out_first, first.to(dtype), mask=mask)
    tl.store(out_first + HALF, second.to(dtype), mask=mask)


def rotate(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query [T, Hq, D]`` and ``key [T, Hk, D]`` by ``cos``/``sin`` ``[T, D/2]`` (new tensors)."""
    check_device(query, key, cos, sin)
    return _rotate_one(query, cos, sin), _rotate_one(key, cos, sin)


def _rotate_one(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    num_tokens, num_heads, head_dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    _rotate_kernel[(num_tokens,)](
        x, cos, sin, out, x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0), num_heads,
        HALF=head_dim // 2, BLOCK_HEADS=next_power_of_2(num_heads), BLOCK_HALF=next_power_of_2(head_dim // 2),
        num_warps=4,
    )
    return out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # F.silu rounds, then the product
    tl.store(out_ptr + row * stride_out + cols, (silu * up).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x [..., 2 * d]`` holding ``gate`` then ``up``."""
    check_device(x)
    width = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * width)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], width), dtype=x.dtype, device=x.device)
    block = min(1024, next_power_of_2(width))
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(width, block))](
            x2, out, x2.stride(0), out.stride(0), width, BLOCK=block, num_warps=4)
    return out.view(*x.shape[:-1], width)


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
                     stride_key_token, stride_key_head, stride_value_token, stride_value_head,
                     stride_cache_slot, stride_cache_head, num_heads,
                     HEAD_DIM: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_DIM: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    dims = tl.arange(0, BLOCK_DIM)[None, :]
    # a negative slot marks a padding row (CUDA-graph batches): nothing is written for it
    mask = (heads < num_heads) & (dims < HEAD_DIM) & (slot >= 0)
    cache_offset = slot * stride_cache_slot + heads * stride_cache_head + dims
    key = tl.load(key_ptr + token * stride_key_token + heads * stride_key_head + dims, mask=mask)
    tl.store(key_cache_ptr + cache_offset, key, mask=mask)
    value = tl.load(value_ptr + token * stride_value_token + heads * stride_value_head + dims, mask=mask)
    tl.store(value_cache_ptr + cache_offset, value, mask=mask)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``key``/``value`` ``[T, Hk, D]`` at ``slot_mapping [T]`` of the caches ``[N, B, Hk, D]``;
    rows whose slot is negative are skipped."""
    check_device(key, value, key_cache, value_cache, slot_mapping)
    num_tokens, num_heads, head_dim = key.shape
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        key, value = key.contiguous(), value.contiguous()
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        num_heads * head_dim, head_dim, num_heads,
        HEAD_DIM=head_dim, BLOCK_HEADS=next_power_of_2(num_heads), BLOCK_DIM=next_power_of_2(head_dim),
        num_warps=4,
    )


def _row_warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16
