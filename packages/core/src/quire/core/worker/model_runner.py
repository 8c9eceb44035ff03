"""Runs one scheduled step: update the persistent batch, build inputs, forward, sample."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from quire.core.attention import get_attention_backend
from quire.core.attention.metadata import AttentionMetadata
from quire.core.config import EngineConfig
from quire.core.models import get_model_class
from quire.core.models.weights import iterate_weights
from quire.core.sched.output import ModelRunnerOutput, SchedulerOutput
from quire.core.worker.input_batch import InputBatch
from quire.core.worker.kv_cache import allocate_kv_caches
from quire.core.worker.sampler import Sampler, SamplingMetadata, build_sampling_metadata


@dataclasses.dataclass
class StepInputs:
    """Tensors for one forward pass, and which rows sample afterwards."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # flat token index of each sampling row's last token
    sampling_rows: np.ndarray  # persistent-batch rows that sample, in logits order


class ModelRunner:
    """Owns the model, its KV cache and the persistent batch of one device."""

    def __init__(self, config: EngineConfig):
        self.config = config
        model_config = config.model
        self.block_size = config.cache.block_size
        backend = get_attention_backend("torch")()
        self.model = get_model_class(model_config.architecture)(model_config, backend)
        self.model.load_weights(iterate_weights(model_config.path))
        self.model.eval()
        max_blocks_per_req = -(-model_config.max_model_len // self.block_size)
        self.input_batch = InputBatch(config.scheduler.max_num_seqs, model_config.max_model_len,
                                      max_blocks_per_req)
        self.sampler = Sampler(torch.Generator().manual_seed(config.seed))
        self.kv_caches: list[torch.Tensor] = []

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(self.config.model, num_blocks, self.block_size,
                                            self.config.device)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_batch(scheduler_output)
        if scheduler_output.is_empty:
            return ModelRunnerOutput({})
        inputs = self._prepare_inputs(scheduler_output.num_scheduled_tokens)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata)
        if len(inputs.sampling_rows) == 0:
            return ModelRunnerOutput({})
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        metadata: SamplingMetadata = build_sampling_metadata(self.input_batch, inputs.sampling_rows)
        sampled = self.sampler(logits, metadata).numpy()
        self.input_batch.append_tokens(inputs.sampling_rows, sampled)
        req_ids = self.input_batch.req_ids
        return ModelRunnerOutput({
            req_ids[row]: [token] for row, token in zip(inputs.sampling_rows.tolist(), sampled.tolist())
        })

    def _update_batch(self, scheduler_output: SchedulerOutput) -> None:
        batch = self.input_batch
        for request_id in scheduler_output.finished_request_ids:
            batch.remove(request_id)
        for data in scheduler_output.new_requests:
            batch.add(data)
        for data in scheduler_output.cached_requests:
            row = batch.index[data.request_id]
            batch.append_blocks(row, data.new_block_ids)
            batch.num_computed_tokens[row] = data.num_computed_tokens

    def _prepare_inputs(self, num_scheduled_tokens: dict[str, int]) -> StepInputs:
        batch = self.input_batch
        rows = np.array(sorted(batch.index[r] for r in num_scheduled_tokens), dtype=np.int64)
        counts = np.array([num_scheduled_tokens[batch.req_ids[r]] for r in rows], dtype=np.int64)
        computed = batch.num_computed_tokens[rows].astype(np.int64)
        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        token_rows = np.repeat(rows, counts)
        positions = (np.repeat(computed - query_start_loc[:-1], counts)
                     + np.arange(num_tokens, dtype=np.int64))
        input_ids = batch.token_ids[token_rows, positions]
        slot_mapping = (batch.block_table[token_rows, positions // self.block_size].astype(np.int64)
                        * self.block_size + positions % self.block_size)
        seq_lens = computed + counts
        max_blocks = int(-(-seq_lens.max() // self.block_size))
        samples = seq_lens == batch.num_tokens[rows]
        metadata = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping),
            block_tables=torch.from_numpy(batch.block_table[rows, :max_blocks].astype(np.int64)),
            query_start_loc=query_start_loc.tolist(),
            seq_lens=seq_lens.tolist(),
            max_query_len=int(counts.max()),
        )
        return StepInputs(
            input_ids=torch.from_numpy(input_ids.astype(np.int64)),
            positions=torch.from_numpy(positions),
            attn_metadata=metadata,
            logits_indices=torch.from_numpy(query_start_loc[1:][samples] - 1),
            sampling_rows=rows[samples],
        )
