"""Quantized weights (``quire.kernels.quant``): the layouts against gguf-py's dequantization, the C++ kernels
(every instruction-set path this CPU has) against the PyTorch references."""

import math
from pathlib import Path

import pytest
import torch

from quire.kernels import cpu_extension, quant

CPU_KERNELS = cpu_extension.load()
GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
# in_features per type: a multiple of 256 and, for the 32-element blocks, one that is not (576 = 18 blocks);
# INT8 takes any K (100: a tail past the kernels' 64-element steps)
IN_FEATURES = {"Q8_0": (576, 768), "Q4_0": (576, 768), "Q4_1": (576, 768), "Q4_K": (512, 768),
               "Q6_K": (512, 768), "INT8": (100, 576)}
OUT_FEATURES = 37  # not a multiple of any tile width
# rows of x: batch-1 decode, tiles of every size (9 = 5 + 4 rows), and the dequantize-and-matmul path (130)
BATCHES = (1, 3, 7, 9, 64, 130)
# the fp16 scale fields of each type: (byte offset, smallest and largest magnitude); the K-quants' ranges reach
# below fp16's smallest normal number (6.1e-5), so subnormal scales are decoded too
SCALE_FIELDS = {"Q8_0": [(0, 1e-4, 1e-3)], "Q4_0": [(0, 1e-3, 1e-2)],
                "Q4_1": [(0, 1e-3, 1e-2), (2, 1e-3, 8e-2)], "Q4_K": [(0, 1e-6, 1e-4), (2, 1e-6, 1e-4)],
                "Q6_K": [(208, 1e-6, 1e-4)]}


def isa_available(isa: str) -> bool:
    if CPU_KERNELS is None:
        return False
    try:
        CPU_KERNELS.quant_isa(isa)
    except RuntimeError:
        return False
    return True


ISAS = [pytest.param(isa, marks=pytest.mark.skipif(not isa_available(isa), reason=(
            "Quire's C++ CPU kernels could not be built here" if CPU_KERNELS is None
            else f"this CPU has no {isa} instructions")))
        for isa in ("avx512", "avx2", "scalar")]


def has_vnni() -> bool:
    try:
        return "avx512_vnni" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


# Q4_0, Q4_1 and Q8_0 on AVX-512 VNNI take the integer path for batches of up to 8 rows (csrc/quant_int_dot.h),
# where a row's result is bit-identical at every batch size; the other vector paths round x at batch 1 only
BATCH_INVARIANT_TYPES = ("Q4_0", "Q4_1", "Q8_0")
MAX_INTEGER_ROWS = 8


def rounds_x(qtype: str, isa: str, rows: int) -> bool:
    """Whether ``quant_linear`` rounds x to int16 per group (the integer path) for this type, path and batch."""
    if isa == "scalar":
        return False
    if isa == "avx512" and qtype in BATCH_INVARIANT_TYPES and has_vnni():
        return rows <= MAX_INTEGER_ROWS
    return rows == 1


BATCH_INVARIANT = pytest.mark.skipif(not (isa_available("avx512") and has_vnni()),
                                     reason="batch invariance is promised on AVX-512 VNNI (Q4_0, Q4_1, Q8_0)")


def random_weight(qtype: str, out_features: int, in_features: int, seed: int) -> quant.QuantizedWeight:
    """Random bytes (any byte is a valid quantized value) with finite fp16 scales, log-uniform in magnitude
    with random signs; INT8 quantizes a random normal weight."""
    generator = torch.Generator().manual_seed(seed)
    if qtype == "INT8":
        return quant.quantize_int8(torch.randn(out_features, in_features, generator=generator) * 0.05)
    block_size, type_size = quant.QUANT_TYPES[qtype]
    num_blocks = in_features // block_size
    raw = torch.randint(0, 256, (out_features, num_blocks, type_size), dtype=torch.uint8, generator=generator)
    for offset, smallest, largest in SCALE_FIELDS[qtype]:
        magnitude = torch.empty(out_features, num_blocks).uniform_(math.log(smallest), math.log(largest),
                                                                   generator=generator).exp()
        sign = torch.randint(0, 2, (out_features, num_blocks), generator=generator) * 2 - 1
        raw[:, :, offset:offset + 2] = (magnitude * sign).half().view(torch.uint8).reshape(out_features, num_blocks, 2)
    return quant.QuantizedWeight.from_gguf_bytes(qtype, raw.reshape(out_features, -1), out_features, in_features)


def assert_bitwise_equal(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.shape == expected.shape and got.dtype == expected.dtype == torch.float32
    mismatches = (got.view(torch.int32) != expected.view(torch.int32)).sum().item()  # -0.0 != 0.0 here
    assert mismatches == 0, f"{mismatches} of {got.numel()} values differ"


def assert_close_to_reference(got, x, weight, bias, rounded_x: bool = False) -> None:
    """``got`` against ``quant_linear_reference``, within the error of float32 accumulation (and of rounding x
    to 16 bits per group of 32 elements, where ``rounded_x``: the vector paths at batch 1).

    Both sum the same products: the dequantized weights are exact float32 values and a bfloat16 x widens
    exactly, so they differ only in the order of the additions (and in whether a product rounds before it is
    added, which FMA does not). A float32 sum of n terms in any order is within (n - 1) * u * sum|term| of
    the exact sum (u = 2^-24), each rounded product adds u * |product|: each result is within
    (K + 1) * u * (sum_k |x_k w_k| + |bias|) of the exact value, and the two results within twice that.
    A wrong weight element or a dropped block moves a result by about sum / K, far outside (K = 100-768).
    A bfloat16 output adds one rounding: at most half a unit in the last place, 2^-8 of the value.

    The integer path (csrc/quant_int_dot.h) rounds x_k to a multiple of max|x| / 32639 over its group of 32:
    each x_k moves by at most half of that, plus a float32 rounding of x_k times the group's reciprocal scale
    (2^-24, counted as 2^-22 of the group's largest for margin). Its results may differ from the float32 sum by
    those moves times |w_k| as well.
    """
    expected = quant.quant_linear_reference(x.float(), weight, bias)
    weights_abs = quant.dequantize_reference(weight).double().abs()
    magnitude = x.double().abs() @ weights_abs.T
    if bias is not None:
        magnitude += bias.double().abs()
    tolerance = 2 * (weight.in_features + 1) * 2.0**-24 * magnitude
    if rounded_x:
        grouped = weight.in_features // 32 * 32
        group_max = x[:, :grouped].double().abs().reshape(x.shape[0], -1, 32).amax(dim=-1)
        moves = torch.zeros(x.shape, dtype=torch.float64)
        moves[:, :grouped] = group_max.repeat_interleave(32, dim=-1) * (1 / 65278 + 2.0**-22)
        tolerance += moves @ weights_abs.T
    if got.dtype == torch.bfloat16:
        tolerance += 2.0**-8 * (expected.double().abs() + tolerance)
    assert got.dtype == x.dtype and got.shape == (x.shape[0], weight.out_features)
    excess = (got.double() - expected.double()).abs() - tolerance
    assert excess.max().item() <= 0, f"{(excess > 0).sum().item()} outputs outside the tolerance"


@pytest.mark.parametrize("qtype", GGUF_TYPES)
def test_dequantize_reference_equals_gguf(qtype):
    gguf = pytest.importorskip("gguf")
    for seed, in_features in enumerate(IN_FEATURES[qtype]):
        weight = random_weight(qtype, OUT_FEATURES, in_features, seed)
        expected = gguf.quants.dequantize(weight.data.numpy(), gguf.GGMLQuantizationType[qtype])
        assert_bitwise_equal(quant.dequantize_reference(weight), torch.from_numpy(expected))
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]] == quant.QUANT_TYPES[qtype]
        assert gguf.GGMLQuantizationType[qtype].value == quant.GGML_TYPE_IDS[qtype]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", [*GGUF_TYPES, "INT8"])
def test_dequantize_kernel_equals_reference(qtype, isa):
    for seed, in_features in enumerate(IN_FEATURES[qtype]):
        weight = random_weight(qtype, OUT_FEATURES, in_features, seed)
        expected = quant.dequantize_reference(weight)
        assert_bitwise_equal(quant.dequantize(weight, isa=isa), expected)
        # an embedding lookup: any shape of ids, repeats allowed
        ids = torch.tensor([[3, 0, 36], [3, 17, 5]])
        got = quant.dequantize(weight, ids, isa=isa)
        assert got.shape == (2, 3, in_features)
        assert_bitwise_equal(got.reshape(-1, in_features), expected[ids.reshape(-1)])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", [*GGUF_TYPES, "INT8"])
def test_quant_linear_matches_reference(qtype, isa):
    generator = torch.Generator().manual_seed(1)
    for seed, in_features in enumerate(IN_FEATURES[qtype]):
        weight = random_weight(qtype, OUT_FEATURES, in_features, seed)
        bias = torch.randn(OUT_FEATURES, generator=generator) * 0.1
        for rows in BATCHES:
            x32 = torch.randn(rows, in_features, generator=generator)
            for x in (x32, x32.to(torch.bfloat16)):
                for b in (None, bias):
                    assert_close_to_reference(quant.quant_linear(x, weight, b, isa=isa), x, weight, b,
                                              rounded_x=rounds_x(qtype, isa, rows))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", [*GGUF_TYPES, "INT8"])
def test_batch_1_with_outliers(qtype, isa):
    # batch 1 rounds x to int16 per group of 32 on the vector paths: x whose magnitudes span orders of magnitude
    # within a group (as activations with outliers do) is where that rounding moves small elements most; an odd
    # number of groups (25) leaves a last block outside the pairs of the VNNI path
    in_features = {"Q4_K": 768, "Q6_K": 768, "INT8": 100}.get(qtype, 800)
    weight = random_weight(qtype, OUT_FEATURES, in_features, seed=6)
    generator = torch.Generator().manual_seed(6)
    for _ in range(8):
        magnitude = torch.randn(1, in_features, generator=generator).mul(2).exp()  # e^-6 to e^6 and beyond
        x = torch.randn(1, in_features, generator=generator) * magnitude
        assert_close_to_reference(quant.quant_linear(x, weight, isa=isa), x, weight, None,
                                  rounded_x=isa != "scalar")
    zeros = torch.zeros(1, in_features)  # a group of zeros: scale 0
    assert torch.equal(quant.quant_linear(zeros, weight, isa=isa), torch.zeros(1, OUT_FEATURES))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q6_K"])
def test_batch_1_non_finite_x_gives_pytorch_results(qtype, isa):
    # int16 cannot hold an infinity or a NaN: such an x takes the float32 path, which keeps PyTorch's results
    weight = random_weight(qtype, OUT_FEATURES, 512, seed=7)
    for bad in (float("inf"), float("-inf"), float("nan")):
        x = torch.randn(1, 512, generator=torch.Generator().manual_seed(7))
        x[0, 100] = bad
        got, expected = quant.quant_linear(x, weight, isa=isa), quant.quant_linear_reference(x, weight)
        assert expected.isfinite().sum() < OUT_FEATURES  # the bad element reaches the outputs
        assert torch.equal(got.isnan(), expected.isnan())
        assert torch.equal(got.isinf(), expected.isinf())
        assert torch.equal(got[expected.isinf()], expected[expected.isinf()])


def rows_alone(x: torch.Tensor, weight: quant.QuantizedWeight, bias=None) -> torch.Tensor:
    return torch.cat([quant.quant_linear(x[i:i + 1], weight, bias) for i in range(x.shape[0])])


@BATCH_INVARIANT
@pytest.mark.parametrize("qtype", BATCH_INVARIANT_TYPES)
def test_rows_are_bit_identical_at_every_batch_size(qtype):
    # speculative decoding verifies 1 + k tokens as rows of one batch: each row's result must be the one it
    # gets alone, bit for bit, so that greedy output does not change. In features: one block, pairs of blocks
    # (576: 18) and an odd number of blocks (800: 25, the last paired with zeros), rows with outliers
    generator = torch.Generator().manual_seed(8)
    for seed, in_features in enumerate((32, 96, 576, 800)):
        weight = random_weight(qtype, OUT_FEATURES, in_features, seed)
        bias = torch.randn(OUT_FEATURES, generator=generator) * 0.1
        magnitude = torch.randn(MAX_INTEGER_ROWS, in_features, generator=generator).mul(2).exp()
        x = torch.randn(MAX_INTEGER_ROWS, in_features, generator=generator) * magnitude
        x[3] = 0  # a row of zeros: every group's scale is 0
        for b in (None, bias):
            alone = rows_alone(x, weight, b)
            for rows in range(2, MAX_INTEGER_ROWS + 1):
                got = quant.quant_linear(x[:rows], weight, b)
                assert_bitwise_equal(got, alone[:rows])
                assert_close_to_reference(got, x[:rows], weight, b, rounded_x=True)
        bf16 = x.to(torch.bfloat16)
        assert torch.equal(quant.quant_linear(bf16, weight).view(torch.int16),
                           rows_alone(bf16, weight).view(torch.int16))


@BATCH_INVARIANT
@pytest.mark.parametrize("qtype", BATCH_INVARIANT_TYPES)
def test_a_non_finite_row_leaves_the_others_bit_identical(qtype):
    # a row holding an infinity or a NaN takes the float32 path alone; in a batch every row is then computed
    # as alone, so the finite rows keep their integer-path results and the bad one PyTorch's
    weight = random_weight(qtype, OUT_FEATURES, 576, seed=9)
    for bad in (float("inf"), float("-inf"), float("nan")):
        x = torch.randn(5, 576, generator=torch.Generator().manual_seed(9))
        x[2, 100] = bad
        got = quant.quant_linear(x, weight)
        assert_bitwise_equal(got, rows_alone(x, weight))
        expected = quant.quant_linear_reference(x, weight)
        assert torch.equal(got.isnan(), expected.isnan()) and torch.equal(got.isinf(), expected.isinf())
        assert got[[0, 1, 3, 4]].isfinite().all()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "INT8"])
def test_quant_linear_long_rows(qtype, isa):
    # longer rows than the kernels read at once: x in K-chunks of 24 KiB (batches up to 8) and decoded
    # weights in chunks of 2048 elements (larger batches)
    in_features = 2100 if qtype == "INT8" else 2304
    weight = random_weight(qtype, 11, in_features, seed=5)
    generator = torch.Generator().manual_seed(5)
    for rows in (1, 4, 8, 9):
        x = torch.randn(rows, in_features, generator=generator)
        assert_close_to_reference(quant.quant_linear(x, weight, isa=isa), x, weight, None,
                                  rounded_x=rounds_x(qtype, isa, rows))


@pytest.mark.skipif(CPU_KERNELS is None, reason="Quire's C++ CPU kernels could not be built here")
def test_kernels_reject_inconsistent_weights():
    weight = random_weight("Q8_0", 4, 64, seed=0)
    with pytest.raises(RuntimeError, match="do not hold 96 elements"):
        quant.quant_linear(torch.zeros(2, 96), weight)
    with pytest.raises(RuntimeError, match="out of range"):
        quant.dequantize(weight, torch.tensor([4]))
    with pytest.raises(RuntimeError, match="unknown isa"):
        quant.quant_linear(torch.zeros(2, 64), weight, isa="sse2")


def test_without_the_kernels_the_references_run(monkeypatch):
    monkeypatch.setattr(cpu_extension, "load", lambda: None)
    assert quant.quant_kernel_isa() == "torch"
    weight = random_weight("Q4_K", OUT_FEATURES, 512, seed=2)
    x = torch.randn(3, 512).to(torch.bfloat16)
    assert torch.equal(quant.quant_linear(x, weight), quant.quant_linear_reference(x, weight))
    ids = torch.tensor([[1, 2], [36, 1]])
    assert torch.equal(quant.dequantize(weight, ids), quant.dequantize_reference(weight)[ids])
    with pytest.raises(RuntimeError, match="not available"):
        quant.quant_linear(x, weight, isa="avx2")


def test_quant_kernel_isa_names_the_path():
    expected = ("avx512", "avx2", "scalar") if CPU_KERNELS is not None else ("torch",)
    assert quant.quant_kernel_isa() in expected


def test_k_quants_need_whole_super_blocks():
    for qtype in ("Q4_K", "Q6_K"):
        with pytest.raises(ValueError, match="in_features: 576 is not a positive multiple of .* 256"):
            quant.QuantizedWeight.from_gguf_bytes(qtype, torch.zeros(2 * 576, dtype=torch.uint8), 2, 576)


def test_from_gguf_bytes_checks_what_it_keeps():
    flat = random_weight("Q4_0", 3, 64, seed=0).data.reshape(-1)
    weight = quant.QuantizedWeight.from_gguf_bytes("Q4_0", flat, 3, 64)
    assert weight.data.shape == (3, 36) and weight.data.data_ptr() == flat.data_ptr()
    assert weight.nbytes == 3 * 36
    with pytest.raises(ValueError, match="qtype: 'Q5_0' is not a supported GGUF type"):
        quant.QuantizedWeight.from_gguf_bytes("Q5_0", flat, 3, 64)
    with pytest.raises(ValueError, match="raw: the bytes must be a uint8 tensor"):
        quant.QuantizedWeight.from_gguf_bytes("Q4_0", flat.to(torch.int8), 3, 64)
    with pytest.raises(ValueError, match=r"raw: \(108,\) bytes do not hold a Q4_0 weight of \[4, 64\]"):
        quant.QuantizedWeight.from_gguf_bytes("Q4_0", flat, 4, 64)
    with pytest.raises(ValueError, match=r"raw: \(2, 54\) bytes"):
        quant.QuantizedWeight.from_gguf_bytes("Q4_0", flat.reshape(2, 54), 3, 64)


@pytest.mark.parametrize("qtype", ["Q6_K", "INT8"])
def test_rows_and_concat_rows(qtype):
    weight = random_weight(qtype, OUT_FEATURES, 512, seed=3)
    part = weight.rows(5, 20)
    assert part.out_features == 15 and part.data.data_ptr() == weight.rows(5, 6).data.data_ptr()
    assert_bitwise_equal(quant.dequantize(part), quant.dequantize_reference(weight)[5:20])
    joined = quant.QuantizedWeight.concat_rows([weight.rows(0, 5), part, weight.rows(20, OUT_FEATURES)])
    assert joined.out_features == OUT_FEATURES and joined.nbytes == weight.nbytes
    assert_bitwise_equal(quant.dequantize(joined), quant.dequantize_reference(weight))
    with pytest.raises(ValueError, match="rows"):
        weight.rows(30, 38)
    with pytest.raises(ValueError, match="does not stack"):
        quant.QuantizedWeight.concat_rows([weight, random_weight("Q8_0", 2, 512, seed=0)])


def test_quantize_int8_round_trip():
    weight = torch.randn(33, 200, generator=torch.Generator().manual_seed(4)) * 0.05
    weight[7] = 0  # an all-zero row: scale 0, no division by zero
    quantized = quant.quantize_int8(weight.to(torch.bfloat16))
    assert quantized.data.dtype == torch.int8 and quantized.scale.dtype == torch.float32
    assert quantized.nbytes == 33 * 200 + 33 * 4
    scale = quantized.scale
    assert scale[7] == 0 and torch.equal(quantized.data.abs().amax(dim=1)[torch.arange(33) != 7],
                                         torch.full((32,), 127, dtype=torch.int8))
    # round to nearest: within half a step, plus the float32 roundings of w / scale and of q * scale (each at
    # most 2^-24 of a value up to 127 steps: 2 * 127 * 2^-24 < 2^-16 of a step)
    error = (quant.dequantize_reference(quantized) - weight.to(torch.bfloat16).float()).abs()
    assert (error <= scale[:, None] * (0.5 + 2.0**-16)).all()
