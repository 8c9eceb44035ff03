"""The C++ ``prefill_attention`` (a whole prompt over its own keys: AMX tiles; on other AVX-512 CPUs the path in
PyTorch's own order where it gives PyTorch's bits; AVX2 FMA elsewhere) against dense attention and PyTorch's
``scaled_dot_product_attention``, and its place in ``run_paged_attention``."""

import pytest
import torch
import torch.nn.functional as F

from quire.kernels import cpu_extension
from quire.kernels.attention import paged_attention, plan_paged_attention, run_paged_attention

from .test_attention import dense_causal_attention, write_requests

CPU_KERNELS = cpu_extension.load()
pytestmark = pytest.mark.skipif(CPU_KERNELS is None or not CPU_KERNELS.prefill_attention_runs(64),
                                reason="prefill_attention needs a CPU with AMX BF16, AVX-512 or AVX2")


def prefill(q, k, v, scale):
    """One prompt of all the rows, into a new tensor."""
    out = torch.empty_like(q)
    CPU_KERNELS.prefill_attention(q, k, v, scale, torch.tensor([[0, q.shape[0]]]), out)
    return out


def sdpa(q, k, v, scale):
    return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                          is_causal=True, scale=scale, enable_gqa=True)[0].transpose(0, 1)


@pytest.mark.parametrize("tokens,num_heads,num_kv_heads,head_dim", [
    (1, 9, 3, 64), (5, 9, 3, 64), (16, 4, 4, 64), (17, 9, 3, 64), (33, 8, 2, 128), (100, 9, 3, 64),
    (257, 4, 1, 32), (300, 2, 2, 256), (45, 4, 2, 48)])
def test_matches_dense_attention_as_closely_as_pytorch(tokens, num_heads, num_kv_heads, head_dim):
    g = torch.Generator().manual_seed(tokens)
    q = torch.randn(tokens, num_heads, head_dim, generator=g).bfloat16()
    k = torch.randn(tokens, num_kv_heads, head_dim, generator=g).bfloat16()
    v = torch.randn(tokens, num_kv_heads, head_dim, generator=g).bfloat16()
    scale = head_dim**-0.5
    exact = dense_causal_attention(q, k, v, scale)
    out = prefill(q, k, v, scale)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    error = (out.float() - exact).abs()
    torch_error = (sdpa(q, k, v, scale).float() - exact).abs()
    # bfloat16 outputs: within a rounding step of the exact result, and no further from it than PyTorch's kernel
    assert error.max() <= 2e-2
    assert error.mean() <= 1.25 * torch_error.mean() + 1e-4


def test_reads_strided_rows_of_a_fused_projection():
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(70, (6 + 2 + 2) * 64, generator=g).bfloat16()
    q, k, v = qkv.split([6 * 64, 2 * 64, 2 * 64], dim=-1)
    q, k, v = q.view(70, 6, 64), k.view(70, 2, 64), v.view(70, 2, 64)
    assert not v.is_contiguous()
    strided = prefill(q, k, v, 0.125)
    dense = prefill(q.contiguous(), k.contiguous(), v.contiguous(), 0.125)
    assert torch.equal(strided, dense)


def test_a_nan_key_reaches_only_the_rows_that_see_it():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(40, 4, 64, generator=g).bfloat16()
    k = torch.randn(40, 2, 64, generator=g).bfloat16()
    v = torch.randn(40, 2, 64, generator=g).bfloat16()
    k[21, 1, 3] = float("nan")
    out = prefill(q, k, v, 0.125)
    assert torch.equal(out.isnan(), sdpa(q, k, v, 0.125).isnan())
    assert out[:21].isfinite().all() and out[21:, 2:].isnan().all() and out[:, :2].isfinite().all()


def test_rejects_what_it_cannot_run():
    q = torch.randn(8, 4, 64).bfloat16()
    with pytest.raises(RuntimeError, match="bfloat16"):
        prefill(q.float(), q.float(), q.float(), 0.125)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        prefill(q, q[:, :3], q[:, :3], 0.125)
    with pytest.raises(RuntimeError, match="scale must be positive"):
        prefill(q, q, q, -0.125)
    assert not CPU_KERNELS.prefill_attention_runs(40) and not CPU_KERNELS.prefill_attention_available(40)


def test_attention_takes_it_only_where_it_runs_and_not_the_avx2_tiles_beside_avx512_bf16():
    """Where the CPU has AVX-512 BF16 but no AMX tiles run, whole prompts take the path in PyTorch's order where it
    matched PyTorch's bits here, else keep PyTorch's SDPA: never the AVX2 tiles, whose float32 order was enough
    there for bfloat16 greedy ids to leave transformers' where margins are clear."""
    for head_dim in (16, 32, 48, 64, 128, 256, 272):
        path = CPU_KERNELS.prefill_attention_path(head_dim)
        assert CPU_KERNELS.prefill_attention_available(head_dim) == (path != "")
        assert CPU_KERNELS.prefill_attention_available(head_dim) <= CPU_KERNELS.prefill_attention_runs(head_dim)
        assert path != "pytorch order" or CPU_KERNELS.sdpa_order_runs(head_dim)
    with open("/proc/cpuinfo") as cpuinfo:
        flags = cpuinfo.read()
    if "avx512_bf16" in flags and "amx_bf16" not in flags:
        assert {CPU_KERNELS.prefill_attention_path(d) for d in (32, 48, 64, 128)} <= {"pytorch order", ""}


PYTORCH_ORDER = CPU_KERNELS is not None and CPU_KERNELS.sdpa_order_runs(64)


def qkv_rows(tokens, num_heads, num_kv_heads, head_dim, seed, magnitude=2.0):
    """Query, key and value as strided views of one fused projection, as the models hand them over."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g) * magnitude).bfloat16()
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return (q.view(tokens, num_heads, head_dim), k.view(tokens, num_kv_heads, head_dim),
            v.view(tokens, num_kv_heads, head_dim))


# lengths through every branch: keys past the last whole vector only (< 16), the odd vector, one 512-key block
# (sums of up to 192, 384 and 512 keys, odd and even), two and three blocks, short last blocks of query rows with
# and without MKL's edge kernel (those prompts go to PyTorch itself: 257, 579, 1030)
@pytest.mark.skipif(not PYTORCH_ORDER, reason="the path in PyTorch's order needs AVX-512")
@pytest.mark.parametrize("tokens", [1, 5, 16, 17, 33, 45, 100, 192, 193, 200, 257, 301, 385, 512, 513, 579, 772,
                                    1030, 1100])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (4, 2, 128), (6, 2, 48)])
def test_pytorch_order_gives_sdpa_bits_where_it_is_taken(tokens, num_heads, num_kv_heads, head_dim):
    """Where this CPU takes the path (it matched PyTorch's bits when first asked for this head size), every output
    is PyTorch's SDPA's to the bit; where it runs but is not taken, it is still as close to exact attention."""
    q, k, v = qkv_rows(tokens, num_heads, num_kv_heads, head_dim, seed=tokens * 131 + head_dim)
    scale = head_dim**-0.5
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    CPU_KERNELS.prefill_attention_pytorch_order(q, k, v, scale, torch.tensor([[0, tokens]]), out)
    expected = sdpa(q, k, v, scale)
    if CPU_KERNELS.prefill_attention_path(head_dim) == "pytorch order":
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
        assert torch.equal(prefill(q, k, v, scale), out)
    else:
        exact = dense_causal_attention(q, k, v, scale)
        assert (out.float() - exact).abs().mean() <= 1.25 * (expected.float() - exact).abs().mean() + 1e-4


@pytest.mark.skipif(not PYTORCH_ORDER, reason="the path in PyTorch's order needs AVX-512")
@pytest.mark.parametrize("tokens", [40, 600])
@pytest.mark.parametrize("where,position,value", [("q", 5, "nan"), ("k", 21, "nan"), ("k", 3, "inf"),
                                                  ("v", 21, "nan"), ("v", 30, "-inf")])
def test_pytorch_order_spreads_nan_and_inf_as_pytorch_does(tokens, where, position, value):
    """A NaN score makes its row NaN (an infinite one has a pattern of its own); a value that is not finite
    reaches rows before it too, through PyTorch's zero probabilities: the path gives the same patterns (prompts
    with such values go to PyTorch)."""
    q, k, v = (t.contiguous() for t in qkv_rows(tokens, 4, 2, 64, seed=position))
    {"q": q, "k": k, "v": v}[where][position, 1, 3] = float(value)
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    CPU_KERNELS.prefill_attention_pytorch_order(q, k, v, 0.125, torch.tensor([[0, tokens]]), out)
    expected = sdpa(q, k, v, 0.125)
    assert torch.equal(out.isnan(), expected.isnan())
    if CPU_KERNELS.prefill_attention_path(64) == "pytorch order":  # the same bits but for NaN's sign and payload
        finite = ~expected.isnan()
        assert torch.equal(out[finite].view(torch.int16), expected[finite].view(torch.int16))


@pytest.mark.skipif(not PYTORCH_ORDER, reason="the path in PyTorch's order needs AVX-512")
def test_pytorch_order_takes_several_prompts_in_one_call():
    q, k, v = qkv_rows(1700, 9, 3, 64, seed=5)
    ranges = [(0, 45), (45, 45), (50, 650), (650, 909), (909, 1700)]  # 909 - 650 = 259 rows: PyTorch's own
    out = torch.full_like(q, 7.0)
    CPU_KERNELS.prefill_attention_pytorch_order(q, k, v, 0.125, torch.tensor(ranges), out)
    for start, end in ranges:
        if end > start:
            alone = torch.empty(end - start, 9, 64, dtype=torch.bfloat16)
            CPU_KERNELS.prefill_attention_pytorch_order(q[start:end], k[start:end], v[start:end], 0.125,
                                                        torch.tensor([[0, end - start]]), alone)
            assert torch.equal(out[start:end], alone)
            if CPU_KERNELS.prefill_attention_path(64) == "pytorch order":
                assert torch.equal(alone, sdpa(q[start:end], k[start:end], v[start:end], 0.125))
    assert (out[45:50] == 7.0).all()
    wide = torch.zeros(4, 2, 144).bfloat16()
    with pytest.raises(RuntimeError, match="not available for head_dim 144"):
        CPU_KERNELS.prefill_attention_pytorch_order(wide, wide[:, :1], wide[:, :1], 0.1, torch.tensor([[0, 4]]),
                                                    torch.empty_like(wide))


class CountingKernels:
    """The C++ module, counting the prompts ``run_paged_attention`` hands to ``prefill_attention``, which it offers
    wherever it runs (whatever this CPU's choice between it and SDPA)."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return getattr(CPU_KERNELS, name)

    def prefill_attention_available(self, head_dim):
        return CPU_KERNELS.prefill_attention_runs(head_dim)

    def prefill_attention(self, query, key, value, scale, ranges, out):
        self.calls.append(ranges.tolist())
        return CPU_KERNELS.prefill_attention(query, key, value, scale, ranges, out)


def test_whole_prompts_in_a_mixed_batch_read_their_own_keys():
    """Both whole prompts go to the kernel in one call on the step's key rows; the chunk after a cached prefix
    and the decode still read the cache; every row matches dense attention."""
    g = torch.Generator().manual_seed(2)
    seq_lens, query_lens = [37, 60, 90, 21], [37, 12, 1, 21]
    kv, tables, keys, values = write_requests(seq_lens, 64, 16, 2, 64, torch.bfloat16, g)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    query = torch.randn(starts[-1], 6, 64, generator=g).bfloat16()
    # the step's own key/value rows: the last query_len tokens of each request
    step_keys = torch.cat([k[-n:] for k, n in zip(keys, query_lens)])
    step_values = torch.cat([v[-n:] for v, n in zip(values, query_lens)])
    kernels = CountingKernels()
    plan = plan_paged_attention(tables, seq_lens, starts, 16, kernels)
    out = run_paged_attention(query, kv[0], kv[1], plan, 0.125, step_keys, step_values)
    assert kernels.calls == [[[0, 37], [50, 71]]]
    for i, (k, v) in enumerate(zip(keys, values)):
        rows = slice(starts[i], starts[i + 1])
        torch.testing.assert_close(out[rows].float(), dense_causal_attention(query[rows], k, v, 0.125),
                                   atol=2e-2, rtol=2e-2)
    gathered = paged_attention(query, kv[0], kv[1], tables, seq_lens, starts, 0.125, CPU_KERNELS)
    torch.testing.assert_close(out.float(), gathered.float(), atol=2e-2, rtol=2e-2)


def test_several_prompts_in_one_call_equal_one_call_each_and_leave_other_rows():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(120, 6, 64, generator=g).bfloat16()
    k = torch.randn(120, 2, 64, generator=g).bfloat16()
    v = torch.randn(120, 2, 64, generator=g).bfloat16()
    ranges = [(0, 33), (40, 41), (41, 41), (50, 120)]
    out = torch.full_like(q, 7.0)
    CPU_KERNELS.prefill_attention(q, k, v, 0.125, torch.tensor(ranges), out)
    for start, end in ranges:
        if end > start:
            assert torch.equal(out[start:end], prefill(q[start:end], k[start:end], v[start:end], 0.125))
    assert (out[33:40] == 7.0).all() and (out[41:50] == 7.0).all()
    with pytest.raises(RuntimeError, match="outside"):
        CPU_KERNELS.prefill_attention(q, k, v, 0.125, torch.tensor([[100, 121]]), out)
    with pytest.raises(RuntimeError, match="out must be"):
        CPU_KERNELS.prefill_attention(q, k, v, 0.125, torch.tensor([[0, 10]]), out[:, :3])
