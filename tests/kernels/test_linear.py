import pytest
import torch

from quire.kernels import cpu_extension
from quire.kernels import linear as linear_ops

CPU_KERNELS = cpu_extension.load()
needs_kernels = pytest.mark.skipif(CPU_KERNELS is None, reason="Quire's C++ CPU kernels could not be built here")


def reference(x, weight, bias):
    """A bfloat16 GEMM with float32 accumulation, rounded once."""
    out = x.float() @ weight.float().T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def assert_within_float32_sum(got, x, weight, bias):
    """``got`` is a float32 sum of x @ weight.T (+ bias) in some order, rounded once to bfloat16: within the
    worst-case error of a float32 sum of K + 1 terms (K 2^-24 sum |terms|, any order) and one bfloat16 rounding
    (2^-8) of the exact product, computed in float64. (A fixed tolerance does not hold for long rows: where
    1,536 products cancel, float32 sums in different orders differ by 3e-5.)"""
    terms = x.double().abs() @ weight.double().abs().T
    out = x.double() @ weight.double().T
    if bias is not None:
        out, terms = out + bias.double(), terms + bias.double().abs()
    summed = (x.shape[1] + 1) * 2.0 ** -24 * terms
    assert ((got.double() - out).abs() <= summed + 2.0 ** -8 * (out.abs() + summed) + 1e-30).all()


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 64, 67, 128, 300, 600])  # >= 128: float32 GEMM on a panel
# (600: two blocks of rows, the second short)
@pytest.mark.parametrize("out_features,in_features", [(48, 64), (49, 70), (50, 8), (7, 3)])
def test_linear_bf16_kernel_equals_float32_accumulation(rows, out_features, in_features):
    torch.manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    weight = torch.randn(out_features, in_features).to(torch.bfloat16)
    bias = torch.randn(out_features).to(torch.bfloat16)
    for b in (bias, None):
        got = CPU_KERNELS.linear_bf16(x, weight, b)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
        # the same products summed in another order: at most one bfloat16 rounding step apart
        expected = reference(x, weight, b)
        torch.testing.assert_close(got.float(), expected.float(), rtol=2 ** -7, atol=1e-5)
        exact_fraction = (got == expected).float().mean().item()
        assert exact_fraction > 0.95, exact_fraction
    # float32 activations keep a float32 output (no rounding at all)
    got = CPU_KERNELS.linear_bf16(x.float(), weight, bias)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, x.float() @ weight.float().T + bias.float(), rtol=1e-5, atol=1e-5)


@needs_kernels
def test_linear_bf16_gemm_over_runs_of_outputs():
    """Many rows of a wide input: the float32 GEMM path takes the outputs in runs of 256 (2,100: 8 runs and a
    short one), each written to its own columns."""
    torch.manual_seed(7)
    x = torch.randn(256, 4096).to(torch.bfloat16)
    weight = (torch.randn(2100, 4096) * 0.02).to(torch.bfloat16)
    bias = torch.randn(2100).to(torch.bfloat16)
    got = CPU_KERNELS.linear_bf16(x, weight, bias)
    expected = reference(x, weight, bias)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2 ** -7, atol=1e-5)
    assert (got == expected).float().mean().item() > 0.95
    assert (got[:, 2048:] == expected[:, 2048:]).float().mean().item() > 0.95


@needs_kernels
def test_linear_bf16_kernel_rejects_bad_shapes():
    with pytest.raises(RuntimeError, match="shape mismatch"):
        CPU_KERNELS.linear_bf16(torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(4, 9, dtype=torch.bfloat16), None)
    with pytest.raises(RuntimeError, match="must be bfloat16"):
        CPU_KERNELS.linear_bf16(torch.zeros(2, 8), torch.zeros(4, 8), None)


def test_bf16_path_follows_the_cpu():
    path = linear_ops.bf16_path()
    onednn_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if onednn_bf16:
        assert path == "onednn"
    elif CPU_KERNELS is not None and CPU_KERNELS.linear_bf16_vectorized():
        assert path == "kernel"
    else:
        assert path == "torch"
    weight = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert linear_ops.can_prepack(weight) == (path != "torch")
    assert not linear_ops.can_prepack(weight.float())


@pytest.mark.skipif(not linear_ops.can_prepack(torch.zeros(1, 1, dtype=torch.bfloat16)),
                    reason="no prepacked bfloat16 path on this CPU")
@pytest.mark.parametrize("rows", [1, 13, 130])
def test_prepacked_linear_equals_float32_accumulation(rows):
    torch.manual_seed(rows)
    x = torch.randn(rows, 96).to(torch.bfloat16)
    weight = torch.randn(80, 96).to(torch.bfloat16)
    bias = torch.randn(80).to(torch.bfloat16)
    packed = linear_ops.prepack(weight)
    got = linear_ops.linear(x, None, bias, packed)
    torch.testing.assert_close(got.float(), reference(x, weight, bias).float(), rtol=2 ** -7, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_gelu_and_residual_add_match_the_unfused_ops(dtype):
    from quire.kernels.linear import can_prepack, linear, linear_add, linear_gelu, prepack

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(37, 64, generator=generator).to(dtype)
    weight = (torch.randn(96, 64, generator=generator) * 0.2).to(dtype)
    bias = torch.randn(96, generator=generator).to(dtype)
    residual = torch.randn(37, 96, generator=generator).to(dtype)
    packed = prepack(weight) if can_prepack(weight) else None
    reference = x.float() @ weight.float().T + bias.float()
    tolerance = {"rtol": 0, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 3e-2}
    torch.testing.assert_close(linear_gelu(x, weight, bias, packed).float(),
                               torch.nn.functional.gelu(reference), **tolerance)
    torch.testing.assert_close(linear_add(x, weight, bias, residual, packed).float(),
                               reference + residual.float(), **tolerance)
    torch.testing.assert_close(linear(x, weight, bias, packed).float(), reference, **tolerance)


_ONEDNN_GEMV = (CPU_KERNELS is not None and linear_ops.bf16_path() == "onednn"
                and CPU_KERNELS.onednn_gemv_max_rows() > 0)
needs_onednn_gemv = pytest.mark.skipif(not _ONEDNN_GEMV,
                                       reason="no oneDNN-packed bfloat16 weights and AVX-512 BF16 on this CPU")
# Whether this CPU's oneDNN packs bfloat16 weights in blocks onednn_gemv reads (32 outputs wide for its AMX
# kernels, 64 for its AVX-512 BF16 ones on an AMD Zen 4).
ONEDNN_GEMV_LAYOUT = _ONEDNN_GEMV and CPU_KERNELS.onednn_gemv_layout(
    linear_ops.prepack(torch.randn(80, 96).to(torch.bfloat16)).packed)
# how many rows the kernel takes: read after a weight is accepted, whose block width decides it
ONEDNN_GEMV_ROWS = CPU_KERNELS.onednn_gemv_max_rows() if _ONEDNN_GEMV else 0
ONEDNN_AMX_ROWS = 128  # what it takes on AMX tiles (oneDNN's 32-wide blocks); 64 on Zen 4, 8 elsewhere


@needs_onednn_gemv
@pytest.mark.skipif(ONEDNN_GEMV_ROWS != ONEDNN_AMX_ROWS,
                    reason="no AMX tiles here (more than 8 rows go to oneDNN or vdpbf16ps)")
@pytest.mark.parametrize("out_features,in_features", [(80, 192), (49, 96), (33, 70)])
def test_onednn_gemv_amx_tiles_give_each_row_the_same_bits_from_9_to_128_rows(out_features, in_features):
    """Whole 32-row passes read x in place, a last pass of up to 16 rows goes through 16-row tiles (two k-steps in
    flight), of 17 to 31 rows through padded 32-row ones (all of them padded where x's width is not whole tiles:
    70): each sum takes the same k-steps in the same order, so a row's outputs do not depend on the row count (an
    even and an odd number of 32-wide k-steps)."""
    torch.manual_seed(in_features)
    weight = torch.randn(out_features, in_features).to(torch.bfloat16)
    bias = torch.randn(out_features).to(torch.bfloat16)
    packed = linear_ops.prepack(weight)
    x = torch.randn(ONEDNN_AMX_ROWS, in_features).to(torch.bfloat16)
    every = CPU_KERNELS.onednn_gemv(x, packed.packed, bias)
    assert_within_float32_sum(every, x, weight, bias)
    for rows in range(9, ONEDNN_AMX_ROWS):
        assert torch.equal(CPU_KERNELS.onednn_gemv(x[:rows], packed.packed, bias), every[:rows]), rows


@needs_onednn_gemv
@pytest.mark.skipif(not ONEDNN_GEMV_LAYOUT, reason="this CPU's oneDNN packs bfloat16 weights in other blocks")
@pytest.mark.parametrize("out_features,in_features", [(80, 96), (49, 70), (33, 64), (576, 1536), (7, 3)])
def test_onednn_gemv_reads_the_packed_weight_and_equals_float32_accumulation(out_features, in_features):
    torch.manual_seed(out_features + in_features)
    weight = torch.randn(out_features, in_features).to(torch.bfloat16)
    bias = torch.randn(out_features).to(torch.bfloat16)
    packed = linear_ops.prepack(weight)
    assert CPU_KERNELS.onednn_gemv_layout(packed.packed)  # oneDNN packed it the way the kernel reads
    assert packed.gemv_rows == ONEDNN_GEMV_ROWS
    for rows in range(1, ONEDNN_GEMV_ROWS + 1):
        x = torch.randn(rows, in_features).to(torch.bfloat16)
        for b in (bias, None):
            got = CPU_KERNELS.onednn_gemv(x, packed.packed, b)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
            expected = reference(x, weight, b)
            assert_within_float32_sum(got, x, weight, b)
            assert (got == expected).float().mean().item() > 0.95
            assert torch.equal(packed(x, b), got)  # the module sends these rows to the kernel
    more = torch.randn(ONEDNN_GEMV_ROWS + 1, in_features).to(torch.bfloat16)  # oneDNN's own kernels
    torch.testing.assert_close(packed(more, bias).float(), reference(more, weight, bias).float(), rtol=2 ** -7,
                               atol=1e-5)
    with pytest.raises(RuntimeError, match="at most"):
        CPU_KERNELS.onednn_gemv(more, packed.packed, None)


@needs_onednn_gemv
@pytest.mark.skipif(not ONEDNN_GEMV_LAYOUT, reason="this CPU's oneDNN packs bfloat16 weights in other blocks")
@pytest.mark.parametrize("out_features", [80, 49, 130, 576])
def test_onednn_gemv_gives_each_row_the_same_bits_at_every_batch_size(out_features):
    """Whole 64-output blocks (where oneDNN packs them: up to 4 rows, and runs of up to 6 rows from 9 rows) and
    32-output groups give the same sums: a row's outputs do not depend on how many rows share the call (every
    row count of the vdpbf16ps kernel; AMX tiles, from 9 rows where oneDNN packs 32-wide blocks, sum in an
    order of their own)."""
    torch.manual_seed(out_features)
    weight = torch.randn(out_features, 192).to(torch.bfloat16)
    bias = torch.randn(out_features).to(torch.bfloat16)
    packed = linear_ops.prepack(weight)
    amx_tiles = ONEDNN_GEMV_ROWS == ONEDNN_AMX_ROWS  # (32-wide blocks: more than 8 rows go to AMX tiles)
    x = torch.randn(8 if amx_tiles else ONEDNN_GEMV_ROWS, 192).to(torch.bfloat16)
    alone = torch.cat([CPU_KERNELS.onednn_gemv(x[i:i + 1], packed.packed, bias) for i in range(len(x))])
    for rows in range(2, len(x) + 1):
        assert torch.equal(CPU_KERNELS.onednn_gemv(x[:rows], packed.packed, bias), alone[:rows])


@needs_onednn_gemv
@pytest.mark.skipif(not ONEDNN_GEMV_LAYOUT, reason="this CPU's oneDNN packs bfloat16 weights in other blocks")
def test_onednn_gemv_reads_x_in_place_or_copied_with_the_same_bits():
    """Rows whose width fills whole 32-wide groups are read where they lie; rows at an odd bfloat16 address are
    copied first (as rows of other widths are, with zero padding: the test above): the same sums either way."""
    torch.manual_seed(5)
    weight = torch.randn(130, 96).to(torch.bfloat16)
    packed = linear_ops.prepack(weight)
    rows = min(ONEDNN_GEMV_ROWS, 12)
    storage = torch.randn(rows * 96 + 1).to(torch.bfloat16)
    aligned = storage[:rows * 96].view(rows, 96)
    odd = storage[1:].view(rows, 96)  # contiguous, 2 bytes past a 4-byte boundary
    assert odd.data_ptr() % 4 == 2
    for x in (aligned, odd):
        got = CPU_KERNELS.onednn_gemv(x, packed.packed, None)
        assert torch.equal(got, CPU_KERNELS.onednn_gemv(x.clone(), packed.packed, None))  # a fresh, aligned copy
        assert_within_float32_sum(got, x, weight, None)


@needs_onednn_gemv
@pytest.mark.skipif(ONEDNN_GEMV_LAYOUT, reason="this CPU's oneDNN packs bfloat16 weights the way onednn_gemv reads")
def test_weights_onednn_packs_otherwise_go_to_onednns_own_kernels():
    torch.manual_seed(3)
    weight = torch.randn(80, 96).to(torch.bfloat16)
    packed = linear_ops.prepack(weight)
    assert not CPU_KERNELS.onednn_gemv_layout(packed.packed) and packed.gemv_rows == 0
    for rows in (1, ONEDNN_GEMV_ROWS):
        x = torch.randn(rows, 96).to(torch.bfloat16)
        torch.testing.assert_close(packed(x, None).float(), reference(x, weight, None).float(), rtol=2 ** -7,
                                   atol=1e-5)


@needs_onednn_gemv
def test_onednn_gemv_layout_refuses_weights_it_cannot_read():
    assert not CPU_KERNELS.onednn_gemv_layout(torch.zeros(4, 8, dtype=torch.bfloat16))  # not packed
    assert not CPU_KERNELS.onednn_gemv_layout(torch.zeros(4, 8).to_mkldnn())  # float32
    nan = torch.zeros(8, 8, dtype=torch.bfloat16)
    nan[3, 5] = float("nan")
    got = CPU_KERNELS.onednn_gemv(torch.ones(1, 8, dtype=torch.bfloat16), linear_ops.prepack(nan).packed, None)
    assert got[0, 3].isnan() and not got[0, :3].isnan().any()
