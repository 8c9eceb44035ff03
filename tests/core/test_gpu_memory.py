"""The device-independent parts of GPU start-up, run on the CPU: the profiling forward pass that sizes
the KV cache on GPUs, and device resolution."""

from __future__ import annotations

import pytest
import torch

from quire.core.engine_args import EngineArgs
from quire.core.errors import ConfigError
from quire.core.worker.gpu_memory import profile_forward, resolve_device
from quire.core.worker.model_runner import ModelRunner


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_profiling_forward_runs_the_largest_step(llama_checkpoint, backend):
    # 300 batched tokens over a 128-token context: three dummy sequences (128, 128, 44)
    config = EngineArgs(model=str(llama_checkpoint), dtype="float32", max_num_batched_tokens=300, max_num_seqs=4,
                        max_model_len=128, device="cpu", attention_backend=backend).create_engine_config()
    runner = ModelRunner(config)
    profile_forward(runner)
    assert runner.kv_caches == []  # the scratch cache was the profiler's own


def test_device_resolution():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            resolve_device("cuda")
