"""The screened greedy LM head names exactly the full head's argmax (``onednn_gemv``'s bfloat16 logits, first
index on a tie), or declines."""

from __future__ import annotations

import pytest
import torch

from quire.kernels import cpu_extension, greedy_head
from quire.kernels import linear as linear_ops
from quire.kernels.sampling import argmax

KERNELS = cpu_extension.load()
pytestmark = pytest.mark.skipif(
    linear_ops.bf16_path() != "onednn" or KERNELS is None or not KERNELS.greedy_head_supported(),
    reason="the screen runs on oneDNN-packed heads with AVX-512 VNNI")


def head_of(weight: torch.Tensor):
    packed = linear_ops.prepack(weight)
    head = greedy_head.greedy_head(packed)
    assert head is not None
    return packed, head


def full_argmax(packed, x: torch.Tensor) -> torch.Tensor:
    return argmax(packed(x, None))


@pytest.mark.parametrize(("num_outputs", "width"), [(1000, 64), (2051, 96), (49152, 576), (333, 256)])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_screened_tokens_equal_the_full_heads_argmax(num_outputs, width, rows):
    generator = torch.Generator().manual_seed(num_outputs * 10 + rows)
    weight = (torch.randn(num_outputs, width, generator=generator) * 0.05).bfloat16()
    packed, head = head_of(weight)
    for scale in (0.1, 1.0, 30.0):  # small and large hidden states: the bound scales with them
        x = (torch.randn(rows, width, generator=generator) * scale).bfloat16()
        tokens = head(x)
        assert tokens is not None and tokens.dtype == torch.int64
        assert torch.equal(tokens, full_argmax(packed, x))


def test_an_exact_tie_goes_to_the_first_index():
    generator = torch.Generator().manual_seed(1)
    weight = (torch.randn(3000, 128, generator=generator) * 0.05).bfloat16()
    x = torch.randn(4, 128, generator=generator).bfloat16()
    winners = argmax(x.float() @ weight.float().T)
    weight[2999] = weight[winners[0]]
    weight[5] = weight[winners[0]]  # row 0's best output now also at 5 (first) and 2999: the same bits
    packed, head = head_of(weight)
    tokens = head(x)
    assert tokens is not None and int(tokens[0]) == 5
    assert torch.equal(tokens, full_argmax(packed, x))


def test_it_declines_near_ties_it_cannot_separate_cheaply():
    generator = torch.Generator().manual_seed(2)
    base = torch.randn(1, 128, generator=generator) * 0.05
    weight = (base + torch.randn(3000, 128, generator=generator) * 1e-3).bfloat16()  # every logit alike
    packed, head = head_of(weight)
    x = torch.randn(2, 128, generator=generator).bfloat16()
    assert head(x) is None


@pytest.mark.parametrize("special", [float("nan"), float("inf")])
def test_it_declines_hidden_states_that_are_not_finite(special):
    packed, head = head_of((torch.randn(500, 64) * 0.05).bfloat16())
    x = torch.randn(2, 64).bfloat16()
    x[1, 7] = special
    assert head(x) is None
    assert head(torch.zeros(1, 64, dtype=torch.bfloat16)) is None  # every logit zero: left to the full head


def test_shapes_it_does_not_take():
    packed, head = head_of((torch.randn(500, 64) * 0.05).bfloat16())
    assert head(torch.randn(greedy_head.MAX_ROWS + 1, 64).bfloat16()) is None  # more rows than onednn_gemv's
    assert head(torch.randn(2, 64)) is None  # float32
    _, odd = head_of((torch.randn(500, 40) * 0.05).bfloat16())  # width not a multiple of 32
    assert odd(torch.randn(1, 40).bfloat16()) is None
    assert greedy_head.greedy_head(linear_ops.KernelLinear((torch.randn(8, 64)).bfloat16())) is None
