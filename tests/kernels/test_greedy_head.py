"""The screened greedy LM head names exactly the full head's argmax (the bfloat16 logits of the head's own path:
``onednn_gemv`` with AVX-512, ``linear_bf16`` on AVX2; first index on a tie), or declines. With AMX tiles or oneDNN's
64-output blocks, rows past the screen's 8 (its 2 on 64-output blocks) take ``onednn_amx_argmax`` or
``onednn_wide_argmax`` (the full head's logits, never written), which must name the same tokens."""

from __future__ import annotations

import pytest
import torch

from quire.kernels import cpu_extension, greedy_head
from quire.kernels import linear as linear_ops
from quire.kernels.sampling import argmax

KERNELS = cpu_extension.load()
# The paths this machine can screen: oneDNN-packed heads (AVX-512 VNNI, where oneDNN has bfloat16) and
# linear_bf16's (AVX2; the head of AVX2 machines, which can be built on any machine that has the kernel).
# oneDNN's packed layout must be the one onednn_gemv reads (some CPUs' oneDNN blocks bfloat16 weights otherwise).
PATHS = [path for path, available in [
    ("onednn", KERNELS is not None and linear_ops.bf16_path() == "onednn" and KERNELS.greedy_head_supported()
     and KERNELS.onednn_gemv_layout(linear_ops.prepack(torch.randn(64, 64).bfloat16()).packed)),
    ("kernel", KERNELS is not None and KERNELS.linear_bf16_vectorized() and KERNELS.greedy_head_bf16_supported()),
] if available]
pytestmark = pytest.mark.skipif(not PATHS, reason="the screen needs AVX-512 VNNI with oneDNN, or AVX2")


@pytest.fixture(params=PATHS)
def path(request):
    return request.param


# the onednn path's rows past the screen's 8, on AMX tiles or oneDNN's 64-output blocks (0 with neither)
FUSED_ROWS = (min(KERNELS.onednn_gemv_max_rows(), max(KERNELS.onednn_amx_max_rows(), KERNELS.onednn_wide_max_rows()))
              if "onednn" in PATHS else 0)
FUSED_ROWS = FUSED_ROWS if FUSED_ROWS > greedy_head.MAX_ROWS else 0


def max_rows(path: str) -> int:
    if path == "onednn":
        return FUSED_ROWS or greedy_head.MAX_ROWS
    return greedy_head.KERNEL_MAX_ROWS


def head_of(weight: torch.Tensor, path: str):
    packed = linear_ops.prepack(weight) if path == "onednn" else linear_ops.KernelLinear(weight)
    head = greedy_head.greedy_head(packed)
    assert head is not None and head.max_rows == max_rows(path)
    return packed, head


def full_argmax(packed, x: torch.Tensor) -> torch.Tensor:
    return argmax(packed(x, None))


@pytest.mark.parametrize(("num_outputs", "width"), [(1000, 64), (2051, 96), (49152, 576), (333, 256)])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 32, 64])
def test_screened_tokens_equal_the_full_heads_argmax(path, num_outputs, width, rows):
    if rows > max_rows(path):
        pytest.skip(f"the {path} head takes up to {max_rows(path)} rows")
    generator = torch.Generator().manual_seed(num_outputs * 10 + rows)
    weight = (torch.randn(num_outputs, width, generator=generator) * 0.05).bfloat16()
    packed, head = head_of(weight, path)
    for scale in (0.1, 1.0, 30.0):  # small and large hidden states: the bound scales with them
        x = (torch.randn(rows, width, generator=generator) * scale).bfloat16()
        tokens = head(x)
        assert tokens is not None and tokens.dtype == torch.int64
        assert torch.equal(tokens, full_argmax(packed, x))


def test_an_exact_tie_goes_to_the_first_index(path):
    generator = torch.Generator().manual_seed(1)
    weight = (torch.randn(3000, 128, generator=generator) * 0.05).bfloat16()
    x = torch.randn(4, 128, generator=generator).bfloat16()
    winners = argmax(x.float() @ weight.float().T)
    weight[2999] = weight[winners[0]]
    weight[5] = weight[winners[0]]  # row 0's best output now also at 5 (first) and 2999: the same bits
    packed, head = head_of(weight, path)
    tokens = head(x)
    assert tokens is not None and int(tokens[0]) == 5
    assert torch.equal(tokens, full_argmax(packed, x))


def test_it_declines_near_ties_it_cannot_separate_cheaply(path):
    generator = torch.Generator().manual_seed(2)
    base = torch.randn(1, 128, generator=generator) * 0.05
    weight = (base + torch.randn(3000, 128, generator=generator) * 1e-3).bfloat16()  # every logit alike
    packed, head = head_of(weight, path)
    x = torch.randn(2, 128, generator=generator).bfloat16()
    assert head(x) is None


@pytest.mark.parametrize("special", [float("nan"), float("inf")])
def test_it_declines_hidden_states_that_are_not_finite(path, special):
    packed, head = head_of((torch.randn(500, 64) * 0.05).bfloat16(), path)
    x = torch.randn(2, 64).bfloat16()
    x[1, 7] = special
    assert head(x) is None
    assert head(torch.zeros(1, 64, dtype=torch.bfloat16)) is None  # every logit zero: left to the full head


def test_shapes_it_does_not_take(path):
    packed, head = head_of((torch.randn(500, 64) * 0.05).bfloat16(), path)
    assert head(torch.randn(max_rows(path) + 1, 64).bfloat16()) is None  # more rows than the path's tiles
    assert head(torch.randn(2, 64)) is None  # float32
    _, odd = head_of((torch.randn(500, 40) * 0.05).bfloat16(), path)  # width not a multiple of 32 (or 16)
    assert odd(torch.randn(1, 40).bfloat16()) is None
    assert greedy_head.greedy_head(lambda x, bias: x) is None  # not a prepacked head


fused_only = pytest.mark.skipif(not FUSED_ROWS, reason="rows past 8 on the onednn path need AMX tiles or oneDNN's "
                                "64-output blocks")


@fused_only
@pytest.mark.parametrize(("num_outputs", "width"), [(1000, 64), (2051, 96), (49152, 576), (100, 40)])
@pytest.mark.parametrize("rows", [9, 16, 17, 33, 64, 100, 128])
def test_rows_past_the_screen_get_the_full_heads_argmax(num_outputs, width, rows):
    # widths that fill 32-wide k-steps and one that does not (40: padded rows); a vocabulary that is not a whole
    # number of 32-output (or 64-output) blocks; every way amx_groups takes the rows (whole 32s, 16-row and 32-row
    # tails), and runs of 5 and 4 rows to 6-row runs on 64-output blocks
    if rows > FUSED_ROWS:
        pytest.skip(f"the fused head takes up to {FUSED_ROWS} rows here")
    generator = torch.Generator().manual_seed(num_outputs + rows)
    weight = (torch.randn(num_outputs, width, generator=generator) * 0.05).bfloat16()
    packed, head = head_of(weight, "onednn")
    for scale in (0.1, 30.0):
        x = (torch.randn(rows, width, generator=generator) * scale).bfloat16()
        tokens = head(x)
        assert tokens is not None and tokens.dtype == torch.int64
        assert torch.equal(tokens, full_argmax(packed, x))


@pytest.mark.skipif("onednn" not in PATHS or not KERNELS.onednn_wide_max_rows(),
                    reason="the fused head for a few rows needs oneDNN's 64-output blocks (AVX-512 BF16 without AMX)")
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8])
def test_a_few_rows_on_64_output_blocks_get_the_full_heads_argmax(rows):
    # where oneDNN packs 64-output blocks the fused head also takes 1 to 8 rows (from 3 rows in place of the
    # screen): runs of 1-4 rows on whole blocks, 5-8 on 32-output halves, as onednn_gemv computes them
    generator = torch.Generator().manual_seed(rows)
    weight = (torch.randn(2051, 96, generator=generator) * 0.05).bfloat16()
    packed, head = head_of(weight, "onednn")
    for scale in (0.1, 30.0):
        x = (torch.randn(rows, 96, generator=generator) * scale).bfloat16()
        assert torch.equal(KERNELS.onednn_wide_argmax(x, packed.packed), full_argmax(packed, x))
        tokens = head(x)
        assert tokens is not None and torch.equal(tokens, full_argmax(packed, x))
    # a tie in a row of a few: the first index
    winners = argmax(x.float() @ weight.float().T)
    weight[2050] = weight[winners[0]]
    weight[3] = weight[winners[0]]
    packed, head = head_of(weight, "onednn")
    tokens = KERNELS.onednn_wide_argmax(x, packed.packed)
    assert int(tokens[0]) == 3 and torch.equal(tokens, full_argmax(packed, x))


@fused_only
def test_a_tie_past_the_screen_goes_to_the_first_index():
    generator = torch.Generator().manual_seed(3)
    weight = (torch.randn(3000, 128, generator=generator) * 0.05).bfloat16()
    x = torch.randn(12, 128, generator=generator).bfloat16()
    winners = argmax(x.float() @ weight.float().T)
    # row 0's best output also at 2999 (another thread's block), 37 (another lane) and 69 (lane 5 of a later block)
    for n in (2999, 69, 37, 5):
        weight[n] = weight[winners[0]]
    packed, head = head_of(weight, "onednn")
    tokens = head(x)
    assert tokens is not None and int(tokens[0]) == 5
    assert torch.equal(tokens, full_argmax(packed, x))


@fused_only
@pytest.mark.parametrize("special", [float("nan"), float("inf")])
def test_the_fused_head_declines_hidden_states_that_are_not_finite(special):
    packed, head = head_of((torch.randn(500, 64) * 0.05).bfloat16(), "onednn")
    x = torch.randn(20, 64).bfloat16()
    x[13, 7] = special
    assert head(x) is None
    assert torch.equal(head(torch.zeros(20, 64, dtype=torch.bfloat16)), torch.zeros(20, dtype=torch.int64))
