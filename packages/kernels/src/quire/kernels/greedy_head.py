"""Greedy tokens from a bfloat16 LM head without computing every logit, on the CPU.

A plain greedy step (every row takes its most likely token; no logprobs, penalties or other logit changes)
needs only the argmax of each row's logits. At batch 1 the LM head is a fifth of a small model's bytes per
token (SmolLM2-135M: 57 of 270 MB), all of them streamed to find one index. ``GreedyHead`` keeps an int8 copy
of the head (one scale per output) and the C++ side (``greedy_head_tokens`` in ``csrc/onednn_gemv.cpp``)
screens the vocabulary with it: each approximate logit comes with a bound on its distance to the logit
``onednn_gemv`` computes (the weight's and x's rounding, float32 summation, the bfloat16 output), and only the
32-output blocks of the outputs that can still reach the best lower bound are computed exactly, with the same
kernel and bits as ``onednn_gemv``. The token is therefore exactly the full head's argmax (its first index on a
tie). When the screen cannot decide cheaply (x not finite, too many candidates) it declines and the caller
computes the full logits.

With AMX tiles, steps of 9 to 128 rows (past the screen's vdpbf16ps rows) take ``onednn_amx_argmax``
instead: the full head on ``onednn_gemv``'s own tiles, each row's argmax kept as the blocks are computed and
the logits never written (the bits of ``onednn_gemv``'s logits, so the same token). Where oneDNN packs 64-output
blocks (AVX-512 BF16 without AMX), steps of 3 to 64 rows take ``onednn_wide_argmax``: the same on
``onednn_gemv``'s runs of rows. There the screen's int16 dot products cost more than the full head from 3 rows
(SmolLM2-135M's head on two Zen 4 cores: 1 row 1.26 against 1.41 ms for the logits and their argmax, 2 rows 1.52
against 1.62, 3 rows 1.78 against 1.27, 8 rows 3.10 against 1.38): it takes only 1 and 2 rows.

On AVX2 CPUs without oneDNN's bfloat16 path the head is a ``KernelLinear`` (``csrc/linear_bf16.cpp``), and
``greedy_head_tokens_bf16`` screens it the same way (int16 dot products with ``vpmaddwd``), for up to
``KERNEL_MAX_ROWS`` rows (batched decode), recomputing the candidates with ``linear_bf16``'s own code for that
number of rows.
"""

from __future__ import annotations

import torch

from quire.kernels.linear import KernelLinear, OneDNNLinear

MAX_ROWS = 8  # onednn_gemv's vdpbf16ps rows: the exact blocks are computed as it computes them
WIDE_SCREEN_ROWS = 2  # the screen's rows where oneDNN packs 64-output blocks (onednn_wide_argmax from 3)
KERNEL_MAX_ROWS = 64  # linear_bf16's tile rows (from 128 rows it runs a float32 GEMM)
_ROWS_PER_PIECE = 4096  # quantized a piece at a time, to bound the float64 copies' memory


class GreedyHead:
    """``head(hidden)``: each row's greedy token (int64 ``[M]``) for up to ``max_rows`` rows, or None when the
    screen declines. ``head`` is a prepacked LM head without bias: on onednn_gemv's path (``OneDNNLinear``) or
    linear_bf16's (``KernelLinear``)."""

    def __init__(self, head: OneDNNLinear | KernelLinear, kernels):
        self._wide = None  # more rows than the screen takes: the full head's argmax, fused (AMX or 64-wide blocks)
        self._screen_rows = MAX_ROWS
        if isinstance(head, OneDNNLinear):
            self._head = head.packed
            self._tokens = kernels.greedy_head_tokens
            self.max_rows = MAX_ROWS
            amx_rows = min(head.gemv_rows, kernels.onednn_amx_max_rows())  # 0 without AMX tiles
            wide_rows = min(head.gemv_rows, kernels.onednn_wide_max_rows())  # 0 unless oneDNN packs 64 wide
            if amx_rows > MAX_ROWS:
                self._wide = kernels.onednn_amx_argmax
                self.max_rows = amx_rows
            elif wide_rows > MAX_ROWS:
                self._wide = kernels.onednn_wide_argmax
                self._screen_rows = WIDE_SCREEN_ROWS
                self.max_rows = wide_rows
            dense = head.packed.to_dense()
        else:
            self._head = head.weight
            self._tokens = kernels.greedy_head_tokens_bf16
            self.max_rows = KERNEL_MAX_ROWS
            dense = head.weight
        num_outputs = dense.shape[0]
        self.q = torch.empty(dense.shape, dtype=torch.int8)
        self.scale = torch.empty(num_outputs, dtype=torch.float32)
        # per output: the largest |w - scale q| (rounded up), sum |q|, the largest |w|
        self.bound = torch.empty(3, num_outputs, dtype=torch.float32)
        for start in range(0, num_outputs, _ROWS_PER_PIECE):
            rows = slice(start, start + _ROWS_PER_PIECE)
            weight = dense[rows].float()
            largest = weight.abs().amax(dim=1)
            scale = torch.where(largest > 0, largest / 127, torch.ones_like(largest))
            q = torch.round(weight / scale[:, None]).clamp_(-127, 127)
            error = (weight.double() - scale.double()[:, None] * q.double()).abs().amax(dim=1)
            self.q[rows] = q.to(torch.int8)
            self.scale[rows] = scale
            self.bound[0, rows] = (error * (1 + 2**-20)).float()
            self.bound[1, rows] = q.abs().sum(dim=1)
            self.bound[2, rows] = largest

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if hidden.dim() != 2 or not 0 < hidden.shape[0] <= self.max_rows or hidden.dtype != torch.bfloat16:
            return None
        if self._wide is not None and hidden.shape[0] > self._screen_rows:
            tokens = self._wide(hidden, self._head)
        else:
            tokens = self._tokens(hidden, self._head, self.q, self.scale, self.bound)
        return tokens if tokens.numel() else None


def greedy_head(packed) -> GreedyHead | None:
    """A ``GreedyHead`` for a prepacked LM head, or None where the screen does not apply (neither the oneDNN
    nor the kernel path, a layout onednn_gemv cannot read, no AVX-512 VNNI or AVX2 in this build)."""
    if isinstance(packed, OneDNNLinear):
        if packed.gemv_rows < MAX_ROWS:
            return None
        supported = "greedy_head_supported"
    elif isinstance(packed, KernelLinear):
        supported = "greedy_head_bf16_supported"
    else:
        return None
    from quire.kernels import cpu_extension

    kernels = cpu_extension.load()
    if kernels is None or not getattr(kernels, supported)():
        return None
    return GreedyHead(packed, kernels)
