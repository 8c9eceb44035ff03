"""Rotary position embedding (the rotate-half layout used by Llama, Mistral, Qwen and Phi-3).

``rope_inv_freq`` computes the inverse frequencies, including the scaled variants; ``rope_cos_sin``
turns them into a float32 table indexed by position; ``apply_rotary`` rotates queries and keys in place
of their dtype. A table narrower than the heads (partial rotary, Phi-4-mini) rotates each head's leading
dimensions and passes the rest through.
"""

import math
from collections.abc import Sequence

import torch

from quire.kernels import cpu_extension

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def rope_inv_freq(
    head_dim: int,
    theta: float,
    rope_type: str = "default",
    factor: float = 1.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position_embeddings: int = 8192,
    short_factor: Sequence[float] = (),
    long_factor: Sequence[float] = (),
    max_positions: int = 0,
) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` in float32 for the given rope scaling (``head_dim``: the
    rotated dimensions, which partial rotary makes fewer than a head's).

    ``longrope`` (Phi-3) divides each frequency by its entry of ``long_factor`` when the table serves
    ``max_positions`` beyond ``original_max_position_embeddings``, else by ``short_factor``'s. NOTE:
    transformers chooses per forward call (long for every position once the sequence is longer than the
    original context); one table for all positions cannot, so a model whose ``max_model_len`` exceeds the
    original context uses the long factors throughout (as vLLM does) and equals transformers on prompts
    longer than the original context, and one limited to it equals transformers on everything it can run.
    """
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "llama3":
        return _llama3_scale(inv_freq, factor, low_freq_factor, high_freq_factor,
                             original_max_position_embeddings)
    if rope_type == "longrope":
        is_long = max_positions > original_max_position_embeddings
        ext_factors = torch.tensor(long_factor if is_long else short_factor, dtype=torch.float32)
        if ext_factors.shape != inv_freq.shape:
            raise ValueError(f"longrope needs {inv_freq.numel()} factors, got {ext_factors.numel()}")
        return 1.0 / (ext_factors * theta**exponents)  # transformers' order of operations
    return inv_freq


def _llama3_scale(
    inv_freq: torch.Tensor,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
) -> torch.Tensor:
    # Llama 3.1 scaling: wavelengths longer than the original context / low_freq_factor are slowed
    # by `factor`, those shorter than context / high_freq_factor are kept, and the band in between
    # is interpolated linearly in 1 / wavelength.
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, max_positions: int, attention_factor: float = 1.0) -> torch.Tensor:
    """A float32 table ``[max_positions, 2 * len(inv_freq)]``: cos of each frequency, then sin of each, both
    scaled by ``attention_factor`` (longrope's)."""
    positions = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    return table if attention_factor == 1.0 else table * attention_factor


def apply_rotary(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query [T, Hq, D]`` and ``key [T, Hk, D]`` by their token positions ``[T]``.

    The table is float32; it is cast to the activations' dtype before use, as Hugging Face does.
    """
    cos, sin = rotary_factors(positions, cos_sin, query.dtype)
    return rotate(query, key, cos, sin)


def rotary_factors(positions: torch.Tensor, cos_sin: torch.Tensor,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[T, D/2]`` (contiguous) in ``dtype``: computed once per forward, used by
    every layer."""
    half = cos_sin.shape[-1] // 2
    table = cos_sin.index_select(0, positions).to(dtype)
    return table[:, :half].contiguous(), table[:, half:].contiguous()


def rotate(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate queries ``[T, Hq, D]`` and keys ``[T, Hk, D]`` by factors from ``rotary_factors``
    (Quire's C++ kernel on CPUs, Triton on CUDA devices). Factors ``[T, R/2]`` with ``R < D`` (partial
    rotary) rotate the leading ``R`` dimensions of each head and leave the rest as they are."""
    rotary_dim = 2 * cos.shape[-1]
    if rotary_dim < query.shape[-1]:
        query_rotated, key_rotated = rotate(query[..., :rotary_dim], key[..., :rotary_dim], cos, sin)
        return (torch.cat([query_rotated, query[..., rotary_dim:]], dim=-1),
                torch.cat([key_rotated, key[..., rotary_dim:]], dim=-1))
    if query.is_cuda:
        from quire.kernels.triton_ops import elementwise

        return elementwise.rotate(query, key, cos, sin)
    kernels = cpu_extension.for_tensor(query)
    if kernels is not None:
        return kernels.rotate(query, cos, sin), kernels.rotate(key, cos, sin)
    return rotate_reference(query, key, cos, sin)


def rotate_reference(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotate`` in PyTorch ops (whole heads)."""
    return _rotate(query, cos[:, None, :], sin[:, None, :]), _rotate(key, cos[:, None, :], sin[:, None, :])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
