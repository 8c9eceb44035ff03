"""Runs one scheduled step: update the persistent batch, build inputs, forward, sample."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from quire.core.attention import get_attention_backend
from quire.core.attention.metadata import AttentionMetadata
from quire.core.config import EngineConfig, ModelConfig
from quire.core.distributed.group import TensorParallelGroup
from quire.core.errors import ConfigError
from quire.core.lora.request import LoRARequest
from quire.core.models import get_model_entry
from quire.core.models.layers import quantize_int8
from quire.core.models.weights import iterate_weight_shards, iterate_weights, load_weights
from quire.core.sched.output import ModelRunnerOutput, SchedulerOutput
from quire.core.timing import StepTimings
from quire.core.wire import Logprobs
from quire.core.worker.cuda_graphs import CudaGraphRunner
from quire.core.worker.gpu_memory import describe_kernels, profile_kv_blocks, resolve_device
from quire.core.worker.input_batch import InputBatch
from quire.core.worker.kv_cache import allocate_kv_caches, num_kv_blocks
from quire.core.worker.logits_processors import GRAMMAR_BITMASK, unpack_bitmask
from quire.core.worker.multimodal import EncoderOutputs, MRopePositions
from quire.core.worker.rejection_sampler import RejectionSampler
from quire.core.worker.sampler import GREEDY_TEMPERATURE, Sampler, gather_logprobs
from quire.core.worker.sampling_metadata import build_sampling_metadata
from quire.kernels.pooling import pool, truncate_and_normalize


class _NoTimings:
    def mark(self, phase: str) -> None:
        pass


_NO_TIMINGS = _NoTimings()


@dataclasses.dataclass
class StepInputs:
    """Tensors for one forward pass, and which rows sample afterwards.

    NOTE: with ``use_cuda_graph`` the step replays a captured decode graph and ``attn_metadata`` is left
    unprepared (its ``plan`` None): the graph's own plan reads the static buffers the step is copied into.
    """

    input_ids: torch.Tensor
    positions: np.ndarray
    attn_metadata: AttentionMetadata
    use_cuda_graph: bool
    rows: np.ndarray  # persistent-batch rows scheduled in this step, in token order
    query_start_loc: np.ndarray
    sampling_rows: np.ndarray  # rows that sample, in logits order
    logits_indices: torch.Tensor  # flat token index of each sampling row's last token (and its proposals')
    num_spec: np.ndarray | None = None  # speculative decoding: proposed tokens of each sampling row


logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model, its KV cache and the persistent batch of one device.

    With a ``tensor_parallel_group`` of several ranks it owns this rank's shard of the model (and KV heads):
    every rank is given the same steps and samples the same tokens from the gathered logits.
    """

    def __init__(self, config: EngineConfig, tensor_parallel_group: TensorParallelGroup | None = None):
        self.group = tensor_parallel_group or TensorParallelGroup()
        if self.group.world_size > 1:  # this rank's heads and MLP columns; its KV cache holds its KV heads
            config = dataclasses.replace(config, model=config.model.shard(self.group.world_size))
        self.config = config
        self.device = resolve_device(config.device)
        if config.num_threads is not None and self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)  # for the whole process: the engine core owns it
        model_config = config.model
        self.block_size = config.cache.block_size
        backend = config.attention_backend or ("triton" if self.device.type == "cuda" else "torch")
        self.attn_backend = get_attention_backend(backend)(model_config.dtype, str(self.device))
        self.model = load_model(model_config, self.attn_backend, self.device, self.group)
        self.lora = None  # with LoRA: the adapters' slots, and every adapter a request has named
        self.lora_adapters: dict[int, LoRARequest] = {}
        if config.lora is not None:
            from quire.core.lora.manager import LoRAManager

            self.lora = LoRAManager(self.model, model_config, config.lora, self.device)
        logger.info("compute kernels: %s; attention backend: %s", describe_kernels(self.device), backend)
        max_blocks_per_req = -(-model_config.max_model_len // self.block_size)
        self.input_batch = InputBatch(config.scheduler.max_num_seqs, model_config.max_model_len,
                                      max_blocks_per_req)
        self.sampler = Sampler(torch.Generator().manual_seed(config.seed))
        self.rejection_sampler = RejectionSampler(self.sampler.generator)
        self.kv_caches: list[torch.Tensor] = []
        self.cuda_graphs: CudaGraphRunner | None = None
        self.encoder_outputs = EncoderOutputs(self.model, self.device) if model_config.is_multimodal else None
        self.mrope = MRopePositions(self.model) if getattr(self.model, "uses_mrope", False) else None
        # Pooling requests (tasks "embed" and "score") being computed, by id: what their chunks have pooled so far.
        self.pooling: dict[str, PoolingState] = {}

    def num_kv_blocks(self) -> int:
        """KV blocks to allocate: from ``kv_cache_memory`` or the CPU default, or on CUDA devices from a
        profiled forward pass and ``gpu_memory_utilization``."""
        config = self.config
        if not config.model.is_causal:  # an encoder keeps no KV: blocks only count each prompt's tokens
            return config.scheduler.max_num_seqs * -(-config.model.max_model_len // self.block_size) + 1
        if self.device.type == "cuda" and config.cache.kv_cache_memory is None:
            return profile_kv_blocks(self)
        return num_kv_blocks(config.model, config.cache, config.scheduler.max_num_seqs,
                             config.scheduler.max_num_batched_tokens)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        if not self.config.model.is_causal:
            return  # an encoder keeps no KV cache
        self.kv_caches = allocate_kv_caches(self.config.model, num_blocks, self.block_size, self.device)
        # NOTE: no graphs for mixtures of experts: their layers read each expert's row count on the host
        if (self.device.type == "cuda" and not self.config.enforce_eager and self.lora is None
                and self.attn_backend.capabilities.supports_cuda_graphs and self.config.model.num_experts == 0):
            self.cuda_graphs = CudaGraphRunner(
                self.model, self.attn_backend, self.kv_caches, self.config.scheduler.max_num_seqs,
                self.input_batch.block_table.shape[1], self.config.model.max_model_len, self.block_size,
                self.device)
            self.cuda_graphs.capture()

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput, timings: StepTimings | None = None) -> ModelRunnerOutput:
        timings = timings or _NO_TIMINGS
        self._update_batch(scheduler_output)
        if scheduler_output.is_empty:
            return ModelRunnerOutput({})
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        inputs = self._prepare_inputs(scheduler_output.num_scheduled_tokens, spec_tokens)
        if self.lora is not None:
            self._prepare_lora(inputs, scheduler_output)
        embeds = self._input_embeds(inputs) if self.encoder_outputs is not None else None
        timings.mark("prepare_inputs")
        hidden = self._forward(inputs, embeds)
        if self.pooling:
            output = ModelRunnerOutput({}, pooled=self._pool(inputs, hidden))
            timings.mark("forward")
            return output  # a pooling engine runs pooling requests only: nothing samples
        output = ModelRunnerOutput({}, prompt_logprobs=self._prompt_logprobs(inputs, hidden))
        logits = None
        if len(inputs.sampling_rows):
            # (every token samples, as in a decode step: the indices are 0..n-1, strictly increasing)
            indices = inputs.logits_indices
            sampling_hidden = hidden if len(indices) == hidden.shape[0] else hidden[indices]
            if not spec_tokens and scheduler_output.grammar_bitmask is None and self._greedy_without_logits(
                    inputs.sampling_rows, sampling_hidden, output):
                timings.mark("forward")
                timings.mark("sampling")
                return output
            logits = self.model.compute_logits(sampling_hidden)
        timings.mark("forward")
        if logits is not None and spec_tokens:
            self._sample_speculative(inputs, logits, output, spec_tokens, scheduler_output.grammar_bitmask)
        elif logits is not None:
            self._sample(inputs.sampling_rows, logits, output, scheduler_output.grammar_bitmask)
        timings.mark("sampling")
        return output

    def _prepare_lora(self, inputs: StepInputs, scheduler_output: SchedulerOutput) -> None:
        """Put this step's adapters in their slots and tell the LoRA layers which token rows use each."""
        for data in scheduler_output.new_requests:
            if data.lora_request is not None:
                self.lora_adapters[data.lora_request.lora_int_id] = data.lora_request
        token_lora_ids = np.repeat(self.input_batch.lora_ids[inputs.rows], np.diff(inputs.query_start_loc))
        self.lora.prepare_step(token_lora_ids, self.lora_adapters)

    def _input_embeds(self, inputs: StepInputs) -> torch.Tensor | None:
        """Input embeddings with the images' encoder outputs on their placeholder tokens (None: no image
        token in this step)."""
        request_ids = [self.input_batch.req_ids[row] for row in inputs.rows.tolist()]
        return self.encoder_outputs.input_embeds(inputs.input_ids, request_ids, inputs.query_start_loc,
                                                 inputs.positions)

    def _pool(self, inputs: StepInputs, hidden: torch.Tensor) -> dict[str, np.ndarray]:
        """Feed each pooling request's chunk to its pooling; return the vectors of those whose prompt this step
        completed (truncated to their ``dimensions`` and normalised as asked), as float32 numpy arrays."""
        batch = self.input_batch
        computed = batch.num_computed_tokens[inputs.rows]
        ends = computed + np.diff(inputs.query_start_loc) == batch.num_tokens[inputs.rows]
        request_ids = [batch.req_ids[row] for row in inputs.rows.tolist()]
        states = [self.pooling[request_id] for request_id in request_ids]
        if ends.all() and not computed.any() and len({s.options for s in states}) == 1:
            # whole prompts pooled alike (an encoder's steps, short prompts): one batched reduction
            first = states[0]
            vectors = list(truncate_and_normalize(pool(hidden, inputs.query_start_loc, first.pooling_type),
                                                  first.dimensions, first.normalize))
        else:  # vectors may differ in length (each request's dimensions)
            vectors = []
            for i, state in enumerate(states):
                start, stop = int(inputs.query_start_loc[i]), int(inputs.query_start_loc[i + 1])
                state.add_chunk(hidden[start:stop], int(inputs.positions[start]))
                if ends[i]:
                    vectors.append(state.finish())
            request_ids = [request_id for request_id, end in zip(request_ids, ends.tolist()) if end]
            if not request_ids:
                return {}
        if self.config.task == "score":  # a cross-encoder: the relevance of each pair from its [CLS] state
            vectors = list(torch.sigmoid(self.model.classify(torch.stack(vectors).to(hidden.dtype)).float()))
        return {request_id: vector.cpu().numpy() for request_id, vector in zip(request_ids, vectors)}

    def _token_type_ids(self, inputs: StepInputs) -> torch.Tensor | None:
        """A cross-encoder's token types: 1 on the second text of each pair (None: every token is of type 0)."""
        starts = [self.pooling[self.input_batch.req_ids[row]].token_type_start for row in inputs.rows.tolist()]
        if not any(starts):
            return None
        types = np.zeros(int(inputs.query_start_loc[-1]), dtype=np.int64)
        for i, start in enumerate(starts):
            if start:
                types[int(inputs.query_start_loc[i]) + start:int(inputs.query_start_loc[i + 1])] = 1
        return torch.from_numpy(types).to(self.device, non_blocking=True)

    def _forward(self, inputs: StepInputs, embeds: torch.Tensor | None = None) -> torch.Tensor:
        positions = inputs.positions
        if not self.config.model.is_causal:  # an encoder: whole prompts, each attending to itself only
            return self.model(inputs.input_ids, torch.from_numpy(positions).to(self.device, non_blocking=True),
                              inputs.query_start_loc.tolist(), self._token_type_ids(inputs))
        if self.mrope is not None:  # rotary positions: three rows while a prompt with images is computed
            request_ids = [self.input_batch.req_ids[row] for row in inputs.rows.tolist()]
            positions = self.mrope.positions(request_ids, inputs.query_start_loc, positions)
        positions = torch.from_numpy(positions).to(self.device, non_blocking=True)
        if embeds is not None or positions.dim() == 2:
            if inputs.use_cuda_graph:  # a one-token chunk of an image: graphs replay token ids and 1-D positions
                self.attn_backend.prepare(inputs.attn_metadata)
            return self.model(inputs.input_ids, positions, self.kv_caches, inputs.attn_metadata, inputs_embeds=embeds)
        if inputs.use_cuda_graph:
            return self.cuda_graphs.run(inputs.input_ids, positions, inputs.attn_metadata)
        return self.model(inputs.input_ids, positions, self.kv_caches, inputs.attn_metadata)

    def _sample(self, rows: np.ndarray, logits: torch.Tensor, output: ModelRunnerOutput,
                grammar_bitmask: tuple[list[str], np.ndarray] | None = None) -> None:
        """One token for each of ``rows`` (persistent-batch rows, in ``logits`` order)."""
        batch = self.input_batch
        metadata = build_sampling_metadata(batch, rows, logits.shape[-1])
        if grammar_bitmask is not None:
            request_ids, bitmask = grammar_bitmask
            logits_row = {batch.req_ids[row]: i for i, row in enumerate(rows.tolist())}
            metadata.processor_inputs[GRAMMAR_BITMASK] = (
                torch.tensor([logits_row[request_id] for request_id in request_ids], dtype=torch.int64),
                torch.from_numpy(bitmask))
        if logits.device.type != "cpu" and not self.sampler.is_plain_greedy(metadata):
            logits = logits.float().cpu()  # NOTE: the sampler's generators and tables live on the CPU
        sampled = self.sampler(logits, metadata)
        self._record_samples(rows, sampled.token_ids.cpu().numpy(), sampled.logprobs, output)

    def _record_samples(self, rows: np.ndarray, tokens: np.ndarray, logprobs: dict[int, Logprobs],
                        output: ModelRunnerOutput) -> None:
        batch = self.input_batch
        batch.append_tokens(rows, tokens)
        for i, (row, token) in enumerate(zip(rows.tolist(), tokens.tolist())):
            request_id = batch.req_ids[row]
            output.sampled_token_ids[request_id] = [token]
            if i in logprobs:
                output.logprobs[request_id] = logprobs[i]

    def _greedy_without_logits(self, rows: np.ndarray, hidden: torch.Tensor, output: ModelRunnerOutput) -> bool:
        """A plain greedy step (``Sampler.is_plain_greedy``) on a model whose LM head can name each row's argmax
        without computing every logit (``greedy_tokens``: ``quire.kernels.greedy_head`` on CPUs): record the
        tokens as ``_sample`` would. False, with nothing recorded, where that does not apply."""
        if len(rows) > getattr(self.model, "greedy_token_rows", 0) or self.lora is not None:
            return False
        if not (self.input_batch.temperature[rows] < GREEDY_TEMPERATURE).all():
            return False  # (before the metadata: sampled steps skip this path at the cost of one comparison)
        metadata = build_sampling_metadata(self.input_batch, rows, self.config.model.vocab_size)
        if not self.sampler.is_plain_greedy(metadata):
            return False
        tokens = self.model.greedy_tokens(hidden)
        if tokens is None:
            return False
        self._record_samples(rows, tokens.numpy(), {}, output)
        return True

    def _sample_speculative(self, inputs: StepInputs, logits: torch.Tensor, output: ModelRunnerOutput,
                            spec_tokens: dict[str, list[int]],
                            grammar_bitmask: tuple[list[str], np.ndarray] | None = None) -> None:
        """A step that verifies proposals: rows without any sample one token as usual; the others keep the
        proposals the rejection sampler accepts, plus one token of the target model's."""
        batch = self.input_batch
        rows, num_spec = inputs.sampling_rows, inputs.num_spec
        first_logits = np.zeros(len(rows), dtype=np.int64)
        np.cumsum(num_spec[:-1] + 1, out=first_logits[1:])
        plain = num_spec == 0
        plain_bitmask, spec_bitmask = _split_bitmask(grammar_bitmask, set(spec_tokens))
        if plain.any():
            self._sample(rows[plain], logits[torch.from_numpy(first_logits[plain])], output, plain_bitmask)
        speculating = ~plain
        spec_rows = rows[speculating]
        counts = num_spec[speculating]
        spec_logits = logits[torch.from_numpy(np.repeat(first_logits[speculating], counts + 1)
                                              + _ranges(counts + 1))]
        starts = np.cumsum(counts + 1) - (counts + 1)  # each row's first position in spec_logits
        metadata = build_sampling_metadata(batch, spec_rows, logits.shape[-1])
        raw_logits = spec_logits.float().cpu() if metadata.num_logprobs else None  # logprobs: before any mask
        if spec_bitmask is not None:  # each position as its grammar stands after the proposals before it
            spec_logits = spec_logits.float().clone()
            start_of = {batch.req_ids[row]: int(start) for row, start in zip(spec_rows.tolist(), starts.tolist())}
            request_ids, bitmask = spec_bitmask
            positions, seen = [], {}
            for request_id in request_ids:
                positions.append(start_of[request_id] + seen.get(request_id, 0))
                seen[request_id] = seen.get(request_id, 0) + 1
            allowed = unpack_bitmask(torch.from_numpy(bitmask), spec_logits.shape[-1])
            index = torch.tensor(positions, dtype=torch.int64)
            spec_logits[index] = spec_logits[index].masked_fill(~allowed, float("-inf"))
        draft = torch.tensor([token for row in spec_rows.tolist() for token in spec_tokens[batch.req_ids[row]]],
                             dtype=torch.int64)
        num_outputs = batch.num_tokens[spec_rows] - batch.num_prompt_tokens[spec_rows]
        seeds = {i: (batch.seeds[row], int(num_outputs[i])) for i, row in enumerate(spec_rows.tolist())
                 if batch.seeds[row] is not None}
        result = self.rejection_sampler(spec_logits.float().cpu(), draft, counts.tolist(), metadata, seeds=seeds)
        tokens, num_accepted = result.token_ids.numpy(), result.num_accepted.tolist()
        for i, row in enumerate(spec_rows.tolist()):
            kept = tokens[i, :num_accepted[i] + 1]
            start = batch.num_tokens[row]
            batch.token_ids[row, start:start + len(kept)] = kept
            batch.num_tokens[row] += len(kept)
            output.sampled_token_ids[batch.req_ids[row]] = kept.tolist()
            k = metadata.num_logprobs.get(i)
            if k is not None:  # the target's raw logprobs at each output position, as the normal sampler's
                positions = raw_logits[int(starts[i]):int(starts[i]) + len(kept)]
                output.logprobs[batch.req_ids[row]] = gather_logprobs(
                    positions.log_softmax(dim=-1), torch.from_numpy(kept.astype(np.int64)), k)

    def _prompt_logprobs(self, inputs: StepInputs, hidden: torch.Tensor) -> dict[str, Logprobs]:
        """Logprobs of the prompt tokens that this step's chunks predict (for requests that asked)."""
        batch = self.input_batch
        result = {}
        for i, row in enumerate(inputs.rows.tolist()):
            k = batch.num_prompt_logprobs[row]
            if k is None:
                continue
            start, end = int(inputs.query_start_loc[i]), int(inputs.query_start_loc[i + 1])
            first_position = int(inputs.positions[start])
            # position p predicts token p + 1, which is a prompt token while p + 1 < num_prompt_tokens
            last = min(first_position + (end - start), int(batch.num_prompt_tokens[row]) - 1)
            if last <= first_position:
                continue
            logits = self.model.compute_logits(hidden[start:start + last - first_position])
            targets = torch.from_numpy(batch.token_ids[row, first_position + 1:last + 1].astype(np.int64))
            log_probs = logits.float().log_softmax(dim=-1).cpu()
            result[batch.req_ids[row]] = gather_logprobs(log_probs, targets, k)
        return result

    def num_threads(self) -> int:
        return torch.get_num_threads()

    def remove_requests(self, request_ids) -> None:
        self.input_batch.remove_many(request_ids)
        for request_id in request_ids:
            self.pooling.pop(request_id, None)
        if self.encoder_outputs is not None:
            self.encoder_outputs.remove_requests(request_ids)
        if self.mrope is not None:
            self.mrope.remove_requests(request_ids)

    def _update_batch(self, scheduler_output: SchedulerOutput) -> None:
        batch = self.input_batch
        self.remove_requests(scheduler_output.finished_request_ids)
        for data in scheduler_output.new_requests:
            batch.add(data)
            if data.pooling_params is not None:
                pooling = self.config.pooling
                params = data.pooling_params
                self.pooling[data.request_id] = PoolingState(
                    pooling.pooling_type, params.dimensions,
                    pooling.normalize if params.normalize is None else params.normalize, params.token_type_start)
        if self.encoder_outputs is not None:
            self.encoder_outputs.update(scheduler_output)
        if self.mrope is not None:
            for data in scheduler_output.new_requests:
                self.mrope.add(data.request_id, data.token_ids[:data.num_prompt_tokens], data.mm_features)
        for data in scheduler_output.cached_requests:
            row = batch.index[data.request_id]
            batch.append_blocks(row, data.new_block_ids)
            if data.num_released_blocks:  # NOTE: another request may own those blocks now; block 0 is null
                batch.block_table[row, :data.num_released_blocks] = 0
            batch.num_computed_tokens[row] = data.num_computed_tokens
        for request_id, proposal in scheduler_output.scheduled_spec_decode_tokens.items():
            row = batch.index[request_id]  # the proposals follow the known tokens, which they do not extend
            batch.token_ids[row, batch.num_tokens[row]:batch.num_tokens[row] + len(proposal)] = proposal

    def _prepare_inputs(self, num_scheduled_tokens: dict[str, int],
                        spec_tokens: dict[str, list[int]] | None = None) -> StepInputs:
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
        num_spec = np.array([len(spec_tokens.get(batch.req_ids[row], ())) for row in rows.tolist()],
                            dtype=np.int64) if spec_tokens else np.zeros(len(rows), dtype=np.int64)
        samples = seq_lens == batch.num_tokens[rows] + num_spec
        # each sampling row's logits: its last token's, after those of the known token and proposals before it
        sampling_spec = num_spec[samples]
        logits_indices = (np.repeat(query_start_loc[1:][samples] - 1 - sampling_spec, sampling_spec + 1)
                          + _ranges(sampling_spec + 1))
        metadata = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping),
            block_tables=torch.from_numpy(batch.block_table[rows, :max_blocks].astype(np.int64)),
            query_start_loc=query_start_loc.tolist(),
            seq_lens=seq_lens.tolist(),
            max_query_len=int(counts.max()),
            block_size=self.block_size,
        )
        graphs = self.cuda_graphs
        use_cuda_graph = graphs is not None and metadata.max_query_len == 1 and graphs.can_run(len(rows))
        if not use_cuda_graph and self.config.model.is_causal:  # an encoder attends without the paged cache
            self.attn_backend.prepare(metadata)
        return StepInputs(
            input_ids=torch.from_numpy(input_ids.astype(np.int64)).to(self.device, non_blocking=True),
            positions=positions,
            attn_metadata=metadata,
            use_cuda_graph=use_cuda_graph,
            rows=rows,
            query_start_loc=query_start_loc,
            sampling_rows=rows[samples],
            logits_indices=torch.from_numpy(logits_indices).to(self.device, non_blocking=True),
            num_spec=sampling_spec,
        )


class PoolingState:
    """One pooling request's pooling, chunk by chunk (a causal model's prompt may be computed in several
    steps): the first token ("cls"), a float32 running sum ("mean") or the latest token ("last")."""

    def __init__(self, pooling_type: str, dimensions: int | None, normalize: bool,
                 token_type_start: int | None = None):
        self.pooling_type = pooling_type
        self.token_type_start = token_type_start  # a cross-encoder's pair: where token type 1 starts
        self.dimensions = dimensions
        self.normalize = normalize
        self.value: torch.Tensor | None = None
        self.num_tokens = 0
        self.dtype = torch.float32  # the model's, for the mean

    @property
    def options(self) -> tuple[str, int | None, bool]:
        return self.pooling_type, self.dimensions, self.normalize

    def add_chunk(self, hidden: torch.Tensor, first_position: int) -> None:
        """``hidden`` ``[chunk_len, hidden_size]``: the hidden states of prompt tokens ``first_position …``."""
        if self.pooling_type == "last":
            self.value = hidden[-1]
        elif self.pooling_type == "cls":
            if first_position == 0:
                self.value = hidden[0]
        else:
            self.dtype = hidden.dtype
            chunk_sum = hidden.float().sum(dim=0)
            self.value = chunk_sum if self.value is None else self.value + chunk_sum
            self.num_tokens += hidden.shape[0]

    def finish(self) -> torch.Tensor:
        """The pooled vector, float32, truncated and normalised."""
        value = self.value
        if self.pooling_type == "mean":  # averaged in float32, then in the model's dtype as one pass would
            value = (value / self.num_tokens).to(self.dtype)
        return truncate_and_normalize(value[None], self.dimensions, self.normalize)[0]


def _split_bitmask(grammar_bitmask: tuple[list[str], np.ndarray] | None, speculating: set[str]):
    """A step's grammar rows, split between the requests that sample one token and those verifying
    proposals (several rows each, one per position)."""
    if grammar_bitmask is None:
        return None, None
    request_ids, bitmask = grammar_bitmask
    is_spec = np.array([request_id in speculating for request_id in request_ids], dtype=bool)
    parts = []
    for keep in (~is_spec, is_spec):
        ids = [request_id for request_id, k in zip(request_ids, keep.tolist()) if k]
        parts.append((ids, bitmask[keep]) if ids else None)
    return parts[0], parts[1]


def load_model(model_config: ModelConfig, attn_backend, device: torch.device,
               group: TensorParallelGroup | None = None) -> torch.nn.Module:
    """The model of ``model_config`` on ``device``, its weights loaded (this rank's shard with a group of
    several ranks), quantized as configured, prepacked for the device's kernels, in eval mode."""
    if model_config.has_sliding_window and not attn_backend.capabilities.supports_sliding_window:
        raise ConfigError(f"{model_config.architecture} has sliding-window attention layers (window "
                          f"{model_config.sliding_window}), which the {attn_backend.name!r} attention backend does "
                          "not run: use attention_backend='torch', or a max_model_len of at most the window")
    entry = get_model_entry(model_config.architecture)
    sharded = group is not None and group.world_size > 1
    with device:  # parameters and buffers are created on the device
        if sharded:
            model = entry.model_class()(model_config, attn_backend, tensor_parallel_group=group)
        else:
            model = entry.model_class()(model_config, attn_backend)
    if sharded:
        load_weights(model, iterate_weight_shards(model_config.path, model, entry.weights, model_config,
                                                  group.rank, group.world_size),
                     entry.weights, model_config)
    elif model_config.is_gguf:
        from quire.core.models.gguf import GGUFCheckpoint
        from quire.core.models.gguf_weights import load_gguf_weights

        load_gguf_weights(model, GGUFCheckpoint.open(model_config.path), entry.weights, model_config)
    else:
        load_weights(model, iterate_weights(model_config.path), entry.weights, model_config)
    if model_config.quantization == "int8":
        quantize_int8(model)
    model.prepack()
    model.eval()
    return model


def _ranges(lengths: np.ndarray) -> np.ndarray:
    """``0 … n-1`` for each ``n`` of ``lengths``, concatenated."""
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(int(lengths.sum()), dtype=np.int64) - starts
