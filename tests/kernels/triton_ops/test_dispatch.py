"""Triton runs only where it should: CUDA tensors, or the interpreter in tests."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from quire.kernels.triton_ops import check_device, elementwise


def test_launchers_refuse_cpu_tensors_outside_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA device"):
        check_device(torch.zeros(2))
    with pytest.raises(ValueError, match="CUDA device"):
        elementwise.silu_and_mul(torch.zeros(3, 8))


def test_a_cpu_engine_never_imports_triton(tiny_checkpoint, tmp_path):
    """A CPU-only run (no interpreter) generates without importing Triton or Quire's Triton kernels, so
    it cannot launch one."""
    script = tmp_path / "run.py"
    script.write_text(
        "import sys\n"
        "from quire.offline import LLM, SamplingParams\n"
        f"llm = LLM({str(tiny_checkpoint('llama'))!r}, device='cpu', multiprocess=False)\n"
        "out = llm.generate(['hello world'] * 3, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)\n"
        "assert all(len(o.outputs[0].token_ids) == 8 for o in out)\n"
        "loaded = sorted(m for m in sys.modules\n"
        "                if m == 'triton' or m.startswith(('triton.', 'quire.kernels.triton_ops')))\n"
        "print('LOADED', loaded)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "LOADED []" in result.stdout, result.stdout
