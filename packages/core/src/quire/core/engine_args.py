"""User-facing engine options shared by every entry point, turned into a frozen ``EngineConfig``."""

from __future__ import annotations

import dataclasses

from quire.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from quire.core.errors import ConfigError


@dataclasses.dataclass
class EngineArgs:
    """Options as a user gives them (``LLM(...)`` keywords, later server and CLI flags)."""

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    kv_cache_memory: int | None = None
    block_size: int = 16
    seed: int = 0

    def create_engine_config(self) -> EngineConfig:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ConfigError(f"kv_cache_memory must be a positive number of bytes, got "
                              f"{self.kv_cache_memory}")
        model = ModelConfig.from_hf(self.model, dtype=self.dtype, max_model_len=self.max_model_len)
        return EngineConfig(
            model=model,
            cache=CacheConfig(block_size=self.block_size, kv_cache_memory=self.kv_cache_memory),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                      max_num_batched_tokens=self.max_num_batched_tokens),
            tokenizer=self.tokenizer or self.model,
            seed=self.seed,
        )
