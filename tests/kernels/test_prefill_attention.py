"""The C++ ``prefill_attention`` (a whole prompt over its own keys: AMX tiles, or AVX2 FMA where there are none)
against dense attention and
PyTorch's ``scaled_dot_product_attention``, and its place in ``run_paged_attention``."""

import pytest
import torch
import torch.nn.functional as F

from quire.kernels import cpu_extension
from quire.kernels.attention import paged_attention, plan_paged_attention, run_paged_attention

from .test_attention import dense_causal_attention, write_requests

CPU_KERNELS = cpu_extension.load()
pytestmark = pytest.mark.skipif(CPU_KERNELS is None or not CPU_KERNELS.prefill_attention_runs(64),
                                reason="prefill_attention needs a CPU with AMX BF16 or AVX2")


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


def test_attention_takes_it_only_where_it_runs_and_not_beside_avx512_bf16_without_amx():
    """Where the CPU has AVX-512 BF16 but no AMX tiles run, whole prompts keep PyTorch's SDPA (the AVX2 tiles'
    float32 order was enough there for bfloat16 greedy ids to leave transformers' where margins are clear)."""
    for head_dim in (16, 32, 48, 64, 128, 256, 272):
        assert CPU_KERNELS.prefill_attention_available(head_dim) <= CPU_KERNELS.prefill_attention_runs(head_dim)
    with open("/proc/cpuinfo") as cpuinfo:
        flags = cpuinfo.read()
    if "avx512_bf16" in flags and "amx_bf16" not in flags:
        assert not any(CPU_KERNELS.prefill_attention_available(d) for d in (32, 48, 64, 128))


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
