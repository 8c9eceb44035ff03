"""User-facing engine options shared by every entry point, turned into a frozen ``EngineConfig``."""

from __future__ import annotations

import dataclasses
import os

from quire.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from quire.core.demo import demo_model_path
from quire.core.errors import ConfigError


@dataclasses.dataclass
class EngineArgs:
    """Options as a user gives them (``LLM(...)`` keywords, later server and CLI flags).

    ``model`` is a local checkpoint folder; None means the embedded quire-demo model.
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    kv_cache_memory: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    long_prefill_token_threshold: int = 0
    max_logprobs: int = 20
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    max_queue_time: float | None = None  # seconds a request may wait for its first step
    # The engine core in its own process; QUIRE_MULTIPROCESS_ENGINE=0 makes in-process the default.
    multiprocess: bool = dataclasses.field(
        default_factory=lambda: os.environ.get("QUIRE_MULTIPROCESS_ENGINE", "1") != "0")
    seed: int = 0
    # Threads of the engine's matrix and attention kernels on CPUs (None: one per core, torch's default).
    num_threads: int | None = None
    device: str = "auto"  # "auto" (CUDA when available), "cpu", "cuda" or "cuda:N"
    gpu_memory_utilization: float = 0.9  # share of GPU memory for weights, activations and KV cache
    enforce_eager: bool = False  # no CUDA graphs
    attention_backend: str | None = None  # "torch" or "triton"; None picks by device
    # Streamed outputs every this many tokens (fewer, larger chunks: less front-end work per token).
    stream_interval: int = 1

    def create_engine_config(self) -> EngineConfig:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ConfigError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}")
        if self.long_prefill_token_threshold < 0 or self.max_logprobs < -1:
            raise ConfigError("long_prefill_token_threshold must be >= 0 and max_logprobs >= -1")
        if self.stream_interval < 1:
            raise ConfigError(f"stream_interval must be at least 1, got {self.stream_interval}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"num_threads must be at least 1, got {self.num_threads}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ConfigError(f"kv_cache_memory must be a positive number of bytes, got "
                              f"{self.kv_cache_memory}")
        if self.max_queue_time is not None and self.max_queue_time <= 0:
            raise ConfigError(f"max_queue_time must be a positive number of seconds, got {self.max_queue_time}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.device != "auto" and self.device != "cpu" and not self.device.startswith("cuda"):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N; got {self.device!r}")
        if self.attention_backend not in (None, "torch", "triton"):
            raise ConfigError(f"attention_backend must be torch or triton, got {self.attention_backend!r}")
        model_path = self.model if self.model is not None else str(demo_model_path())
        model = ModelConfig.from_hf(model_path, dtype=self.dtype, max_model_len=self.max_model_len)
        return EngineConfig(
            model=model,
            cache=CacheConfig(block_size=self.block_size, kv_cache_memory=self.kv_cache_memory,
                              enable_prefix_caching=self.enable_prefix_caching,
                              gpu_memory_utilization=self.gpu_memory_utilization),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                      max_num_batched_tokens=self.max_num_batched_tokens,
                                      policy=self.scheduling_policy,
                                      long_prefill_token_threshold=self.long_prefill_token_threshold,
                                      max_num_queued_reqs=self.max_num_queued_reqs,
                                      max_num_queued_tokens=self.max_num_queued_tokens,
                                      max_queue_time=self.max_queue_time),
            tokenizer=self.tokenizer or model_path,
            seed=self.seed,
            max_logprobs=self.max_logprobs,
            multiprocess=self.multiprocess,
            num_threads=self.num_threads,
            device=self.device,
            attention_backend=self.attention_backend,
            enforce_eager=self.enforce_eager,
            stream_interval=self.stream_interval,
        )


_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_byte_size(text: str | int) -> int:
    """``"4GiB"``, ``"512MB"`` or ``"1048576"`` as a number of bytes."""
    if isinstance(text, int):
        return text
    value = str(text).strip().lower().replace(" ", "")
    number = value.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = value[len(number):]
    if not number or unit not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 4GiB, 512MB or a number of bytes)")
    return int(float(number) * _SIZE_UNITS[unit])
