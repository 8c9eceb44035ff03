"""Choosing the device, naming the kernels it runs, and sizing the KV cache from what is left of a GPU after a
profiled forward pass."""

from __future__ import annotations

import logging

import numpy as np
import torch

from quire.core.attention.metadata import AttentionMetadata
from quire.core.errors import ConfigError
from quire.core.worker.kv_cache import allocate_kv_caches, blocks_per_sequence

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """``"auto"``: the first CUDA device when torch sees one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} was asked for, but torch sees no CUDA device")
    return device


@torch.inference_mode()
def profile_kv_blocks(runner) -> int:
    """How many KV blocks (the reserved null block included) fit in ``gpu_memory_utilization`` of the
    GPU once the weights, the peak activations of a full-sized step and other processes are counted."""
    config, device = runner.config, runner.device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    profile_forward(runner)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    not_torch = total - free - torch.cuda.memory_reserved(device)  # the CUDA context, other processes
    budget = int(total * config.cache.gpu_memory_utilization) - peak - not_torch
    model = config.model
    bytes_per_block = model.kv_bytes_per_token * config.cache.block_size
    num_blocks = max(0, budget) // bytes_per_block
    needed = blocks_per_sequence(model, config.cache.block_size, config.scheduler.max_num_batched_tokens) + 1
    logger.info("GPU memory: %.2f GiB total, peak of a profiled step %.2f GiB, other %.2f GiB: %d KV blocks",
                total / 2**30, peak / 2**30, not_torch / 2**30, num_blocks)
    if num_blocks < needed:
        raise ConfigError(
            f"gpu_memory_utilization={config.cache.gpu_memory_utilization} leaves room for {num_blocks} KV "
            f"blocks, but one sequence of max_model_len={model.max_model_len} needs {needed}: raise "
            f"gpu_memory_utilization, or lower max_model_len or max_num_batched_tokens")
    return int(num_blocks)


def profile_forward(runner) -> None:
    """One forward pass and logits of the largest step the scheduler can send, on dummy tokens and a
    scratch KV cache just big enough for them."""
    config = runner.config
    model_config, block_size = config.model, config.cache.block_size
    scheduler = config.scheduler
    num_tokens = min(scheduler.max_num_batched_tokens, scheduler.max_num_seqs * model_config.max_model_len)
    seq_len = min(num_tokens, model_config.max_model_len)
    lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
    blocks_per_seq = -(-seq_len // block_size)
    block_tables = 1 + np.arange(len(lens) * blocks_per_seq, dtype=np.int64).reshape(len(lens), blocks_per_seq)
    positions = np.concatenate([np.arange(n, dtype=np.int64) for n in lens])
    rows = np.repeat(np.arange(len(lens)), lens)
    slot_mapping = block_tables[rows, positions // block_size] * block_size + positions % block_size
    query_start_loc = np.concatenate([[0], np.cumsum(lens)]).tolist()
    kv_caches = allocate_kv_caches(model_config, block_tables.size + 1, block_size, runner.device)
    metadata = AttentionMetadata(slot_mapping=torch.from_numpy(slot_mapping),
                                 block_tables=torch.from_numpy(block_tables), query_start_loc=query_start_loc,
                                 seq_lens=lens, max_query_len=seq_len, block_size=block_size)
    runner.attn_backend.prepare(metadata)
    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=runner.device)
    hidden = runner.model(input_ids, torch.from_numpy(positions).to(runner.device), kv_caches, metadata)
    runner.model.compute_logits(hidden[-min(num_tokens, scheduler.max_num_seqs):])
    del kv_caches, hidden


def describe_kernels(device: torch.device) -> str:
    """Which kernels run this device's arithmetic, in one line (start-up log, ``quire env``); on CPUs this
    never builds the C++ kernels."""
    if device.type == "cuda":
        return f"Triton on {torch.cuda.get_device_name(device)}"
    from quire.kernels import cpu_extension

    return cpu_extension.describe()
