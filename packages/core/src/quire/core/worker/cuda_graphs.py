"""Decode steps replayed from CUDA graphs: one graph per captured batch size, static buffers owned here."""

from __future__ import annotations

import logging
import time

import torch

from quire.core.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class CudaGraphRunner:
    """Captures the model's forward for pure decode batches and replays it.

    A batch of ``n`` requests runs in the graph of the smallest captured size ``>= n``; the rows past
    ``n`` are padding (slot -1: no KV write; context length 0: zero attention), and their outputs are
    dropped. Every input of a graph lives in the buffers below; ``run`` copies a step's inputs into them.
    """

    def __init__(self, model, attn_backend, kv_caches: list[torch.Tensor], max_num_seqs: int,
                 max_blocks_per_req: int, max_model_len: int, block_size: int, device: torch.device):
        self.model, self.attn_backend, self.kv_caches = model, attn_backend, kv_caches
        self.batch_sizes = [size for size in CAPTURE_SIZES if size <= max_num_seqs]
        if max_num_seqs <= CAPTURE_SIZES[-1] and max_num_seqs not in self.batch_sizes:
            self.batch_sizes.append(max_num_seqs)
        largest = max(self.batch_sizes)
        self.max_model_len, self.block_size = max_model_len, block_size
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((largest, max_blocks_per_req), dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(largest, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @property
    def max_batch_size(self) -> int:
        return max(self.batch_sizes)

    def _metadata(self, size: int) -> AttentionMetadata:
        metadata = AttentionMetadata(slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
                                     query_start_loc=list(range(size + 1)), seq_lens=[0] * size,
                                     max_query_len=1, block_size=self.block_size)
        metadata.plan = self.attn_backend.graph_decode_plan(
            self.slot_mapping[:size], self.block_tables[:size], self.seq_lens[:size],
            self.query_start_loc[:size + 1], self.max_model_len)
        return metadata

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        pool = None
        for size in sorted(self.batch_sizes, reverse=True):  # largest first: the others reuse its memory
            metadata = self._metadata(size)
            args = (self.input_ids[:size], self.positions[:size], self.kv_caches, metadata)
            self.model(*args)  # compiles the kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.model(*args)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batches of %s in %.1f s", self.batch_sizes,
                    time.perf_counter() - start)

    def can_run(self, num_requests: int) -> bool:
        return bool(self.graphs) and num_requests <= self.max_batch_size

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` of a pure decode step of ``n`` requests (inputs on the device,
        except the metadata's host block table and lengths)."""
        num_requests = input_ids.shape[0]
        size = next(s for s in sorted(self.batch_sizes) if s >= num_requests)
        device = self.input_ids.device
        self.input_ids[:num_requests].copy_(input_ids)
        self.positions[:num_requests].copy_(positions)
        self.slot_mapping[:num_requests].copy_(metadata.slot_mapping, non_blocking=True)
        self.slot_mapping[num_requests:size].fill_(-1)
        seq_lens = torch.tensor(metadata.seq_lens, dtype=torch.int32)
        self.seq_lens[:num_requests].copy_(seq_lens.to(device, non_blocking=True))
        self.seq_lens[num_requests:size].zero_()
        num_blocks = metadata.block_tables.shape[1]
        self.block_tables[:num_requests, :num_blocks].copy_(metadata.block_tables.to(device, non_blocking=True))
        self.graphs[size].replay()
        return self.outputs[size][:num_requests]
