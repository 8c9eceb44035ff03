"""How many rows a long CPU step's MLP takes at a time (``quire.core.models.llama.cpu_mlp_chunk_rows``)."""

from pathlib import Path

import torch

from quire.core.models import llama
from quire.kernels import linear as linear_ops


def test_amx_matmul_is_said_exactly_where_onednn_runs_bfloat16_on_a_cpu_with_amx_tiles():
    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    assert linear_ops.amx_matmul() == (linear_ops.bf16_path() == "onednn" and "amx_tile" in flags)


def test_native_bf16_matmul_is_said_where_onednn_runs_bfloat16_on_amx_tiles_or_avx512_bf16():
    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    native = "amx_tile" in flags or "avx512_bf16" in flags
    assert linear_ops.native_bf16_matmul() == (linear_ops.bf16_path() == "onednn" and native)


def test_native_bfloat16_takes_up_to_2048_rows_while_the_intermediate_fits_in_16_mib(monkeypatch):
    monkeypatch.setattr(linear_ops, "native_bf16_matmul", lambda: True)
    assert llama.cpu_mlp_chunk_rows(1536, torch.bfloat16) == 2048  # SmolLM2-135M: 12 MiB of intermediate
    assert llama.cpu_mlp_chunk_rows(2048, torch.bfloat16) == 2048  # exactly 16 MiB
    assert llama.cpu_mlp_chunk_rows(2049, torch.bfloat16) == 1024
    assert llama.cpu_mlp_chunk_rows(4864, torch.bfloat16) == 512  # Qwen2.5-0.5B: 1,024 rows would be 19 MiB
    assert llama.cpu_mlp_chunk_rows(8960, torch.bfloat16) == 256  # Qwen2.5-1.5B: 9 MiB
    assert llama.cpu_mlp_chunk_rows(1 << 20, torch.bfloat16) == 16  # never fewer rows than one tile's
    assert llama.cpu_mlp_chunk_rows(1536, torch.float32) == llama.CPU_MLP_CHUNK_ROWS == 512
    monkeypatch.setattr(linear_ops, "native_bf16_matmul", lambda: False)  # AVX2, or oneDNN's emulated bfloat16
    assert llama.cpu_mlp_chunk_rows(1536, torch.bfloat16) == 512
