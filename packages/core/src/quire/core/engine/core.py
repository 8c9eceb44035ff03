"""``EngineCore``: the scheduler and the executor (which runs the model) driven one step at a time."""

from __future__ import annotations

import logging
import time

from quire.core.config import EngineConfig
from quire.core.engine.executor import default_executor_backend, get_executor_class
from quire.core.engine.faults import Faults
from quire.core.request import Request, RequestStatus
from quire.core.sched.kv_cache_manager import KVCacheManager
from quire.core.sched.scheduler import Scheduler
from quire.core.structured_outputs.manager import StructuredOutputManager
from quire.core.timing import StepTimings
from quire.core.wire import EngineCoreOutputs, EngineCoreRequest

logger = logging.getLogger(__name__)

# While every request waits for its grammar, a step waits this long for one to compile (instead of spinning;
# new input is read between steps, so it is never held up longer than this).
GRAMMAR_WAIT_SECONDS = 0.01


class EngineCore:
    """Loads the model, sizes the KV cache, and runs schedule → execute → update.

    The model runs behind an ``Executor`` chosen by name (``executor_backend``; ``"uniproc"``: one runner
    in this process; ``"mp"``: tensor-parallel workers; default: what the config's tensor_parallel_size
    needs); the engine core never touches a model runner itself.
    """

    def __init__(self, config: EngineConfig, executor_backend: str | None = None):
        self.config = config
        # an unknown name fails before any loading
        executor_class = get_executor_class(executor_backend or default_executor_backend(config))
        self.faults = Faults.from_env()
        self.faults.before_load()
        self.executor = executor_class(config)
        self.num_blocks = self.executor.num_kv_blocks()
        self.executor.initialize_kv_cache(self.num_blocks)
        self.scheduler = Scheduler(
            config.scheduler,
            KVCacheManager(self.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
                           config.model.kv_cache_sliding_window),
            config.model.max_model_len,
            max_loras=config.lora.max_loras if config.lora is not None else None,
        )
        self.structured_outputs = StructuredOutputManager(
            config.tokenizer, config.model.vocab_size, config.scheduler.max_num_seqs,
            config.speculative.num_speculative_tokens if config.speculative is not None else 0)
        if self.faults.enabled:
            logger.warning("test fault injection is enabled: %s", self.faults)
        self.proposer = self.backoff = None
        speculative = config.speculative
        if speculative is not None:
            from quire.core.spec_decode.backoff import SpeculationBackoff

            if speculative.method == "draft_model":
                from quire.core.spec_decode.draft_model import DraftModelProposer

                self.proposer = DraftModelProposer(config, self.num_blocks)
            else:
                from quire.core.spec_decode.ngram import NgramProposer

                self.proposer = NgramProposer(speculative.num_speculative_tokens, speculative.prompt_lookup_min,
                                              speculative.prompt_lookup_max)
            self.backoff = SpeculationBackoff()
        self.num_steps = 0
        self.timings = StepTimings()
        logger.info("engine ready: %s, %d KV blocks of %d tokens", config.model.architecture,
                    self.num_blocks, config.cache.block_size)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.faults.check_request(request.request_id)
        if request.mm_features:
            self._check_mm_features(request)
        core_request = Request(
            request.request_id, request.prompt_token_ids, request.sampling_params,
            tuple(request.eos_token_ids), request.arrival_time, request.priority,
            request.cache_salt, request.bad_words_token_ids, request.mm_features, request.lora_request,
            request.pooling_params,
        )
        if (request.pooling_params is not None) != (self.config.task != "generate"):
            raise ValueError(f"a {'pooling' if request.pooling_params is not None else 'generation'} request "
                             f"reached an engine whose task is {self.config.task!r}")
        if request.pooling_params is not None:
            # a cached prefix has no hidden states to pool: only last-token pooling of a causal model (whose
            # last token is always computed) may skip it
            core_request.skip_prefix_cache = not (self.config.model.is_causal
                                                  and self.config.pooling.pooling_type == "last")
        constraint = request.sampling_params.structured_outputs
        if constraint is not None:
            core_request.structured_output = self.structured_outputs.add_request(
                constraint, request.eos_token_ids, request.prompt_token_ids, request.reasoning_tags)
        self.scheduler.add_request(core_request)

    def _check_mm_features(self, request: EngineCoreRequest) -> None:
        """Images must sit on placeholder tokens of the prompt, in order and apart (the front end puts
        them there; this guards the runner against a malformed request)."""
        placeholder = self.config.model.image_token_id
        if placeholder is None:
            raise ValueError(f"{self.config.model.architecture} takes no images")
        prompt, previous_end = request.prompt_token_ids, 0
        for feature in request.mm_features:
            start, end = feature.offset, feature.offset + feature.length
            if not (previous_end <= start < end <= len(prompt)) or any(t != placeholder for t in prompt[start:end]):
                raise ValueError(f"image {feature.identifier[:12]} at prompt tokens [{start}, {end}) is not on a "
                                 "run of placeholder tokens after the previous image")
            previous_end = end

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self._release_if_idle()

    def _release_if_idle(self) -> None:
        # With no step coming, hand the runner the requests to drop now rather than at the next step.
        if not self.scheduler.has_unfinished_requests():
            removed = self.scheduler.take_removed_request_ids()
            self.executor.remove_requests(removed)
            if self.proposer is not None:
                self._remove_speculation_state(removed)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while requests hold blocks."""
        return self.scheduler.reset_prefix_cache()

    def get_stats(self) -> dict:
        stats = self.scheduler.make_stats()
        return {**{name: getattr(stats, name) for name in stats.__struct_fields__},
                "num_blocks": self.num_blocks, "num_steps": self.num_steps,
                "num_threads": self.executor.num_threads()}

    def get_step_timings(self, reset: bool = False) -> dict:
        """Seconds per phase (schedule, prepare_inputs, forward, sampling, update) and the number of steps."""
        snapshot = self.timings.snapshot()
        if reset:
            self.timings.reset()
        return snapshot

    def check_idle_invariants(self) -> bool:
        """With no request in flight, nothing may be left behind: raise AssertionError if it is."""
        scheduler = self.scheduler
        kv = scheduler.kv_cache_manager
        problems = []
        if scheduler.requests or scheduler.running or len(scheduler.waiting):
            problems.append(f"{len(scheduler.requests)} requests still tracked by the scheduler")
        if kv.req_to_blocks:
            problems.append(f"{len(kv.req_to_blocks)} requests still hold block lists")
        if kv.num_free_blocks != self.num_blocks - 1:
            problems.append(f"{self.num_blocks - 1 - kv.num_free_blocks} KV blocks are not free")
        in_use = [b.block_id for b in kv.block_pool.blocks[1:] if b.ref_cnt != 0]
        if in_use:
            problems.append(f"blocks with references: {in_use[:10]}")
        if scheduler.encoder_cache.num_referenced:
            problems.append(f"{scheduler.encoder_cache.num_referenced} encoder outputs still referenced")
        num_rows = self.executor.num_runner_rows()
        if num_rows:
            problems.append(f"{num_rows} rows left in the model runner")
        if problems:
            raise AssertionError("engine is not idle-clean: " + "; ".join(problems))
        return True

    def step(self) -> EngineCoreOutputs:
        """Run one engine step; with nothing to do, return empty outputs at once (or, while every request
        waits for its grammar to compile, after waiting up to ``GRAMMAR_WAIT_SECONDS`` for one)."""
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(scheduler_stats=self.make_stats(), timestamp=time.monotonic())
        if self.scheduler.only_compiling:
            self.structured_outputs.wait_for_any(self.scheduler.waiting_for_grammar, GRAMMAR_WAIT_SECONDS)
        self.num_steps += 1
        self.faults.before_step(self.num_steps)
        timings = self.timings
        timings.start()
        scheduler_output = self.scheduler.schedule()
        self._fill_grammar_bitmask(scheduler_output)
        timings.mark("schedule")
        runner_output = self.executor.execute_model(scheduler_output, timings)
        self.faults.rewrite_samples(runner_output.sampled_token_ids, self.scheduler.requests)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self.proposer is not None:
            self._remove_speculation_state(scheduler_output.finished_request_ids)
            for request_id in scheduler_output.scheduled_spec_decode_tokens:
                sampled = runner_output.sampled_token_ids.get(request_id)
                if sampled:
                    self.backoff.record(request_id, len(sampled) - 1, self.num_steps)
            self._propose()
        self._release_if_idle()
        timings.mark("update")
        timings.num_steps += 1
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.make_stats(), timestamp=time.monotonic())

    def _propose(self) -> None:
        """Proposed tokens for the next step of every running request that may speculate (its last token
        computed, its sampling plain enough for the rejection sampler, not backed off), unless more requests
        run than ``disable_by_batch_size``."""
        running = self.scheduler.running
        limit = self.config.speculative.disable_by_batch_size
        if limit is not None and len(running) > limit:
            return
        requests = [request for request in running
                    if request.num_tokens - request.num_computed_tokens == 1 and can_speculate(request)
                    and self.backoff.allows(request.request_id, self.num_steps + 1)]
        if requests:
            for request, proposal in zip(requests, self.proposer.propose_requests(requests)):
                if proposal and request.structured_output is not None:
                    proposal = self.structured_outputs.valid_proposal(request, proposal)
                request.spec_token_ids = proposal

    def _remove_speculation_state(self, request_ids) -> None:
        if request_ids:
            self.proposer.remove_requests(request_ids)
            self.backoff.remove_requests(request_ids)

    def _fill_grammar_bitmask(self, scheduler_output) -> None:
        """The token bitmask of the constrained requests that sample in this step."""
        requests, spec_tokens = self.scheduler.requests, scheduler_output.scheduled_spec_decode_tokens
        constrained = []
        for request_id in scheduler_output.num_scheduled_tokens:
            request = requests[request_id]
            if request.structured_output is not None and (
                    request.num_computed_tokens == request.num_tokens + len(spec_tokens.get(request_id, ()))):
                constrained.append(request)
        if constrained:
            scheduler_output.grammar_bitmask = self.structured_outputs.grammar_bitmask(
                constrained, scheduler_output.scheduled_spec_decode_tokens)

    def make_stats(self):
        stats = self.scheduler.make_stats()
        compile_seconds = self.structured_outputs.take_compile_seconds()
        if compile_seconds:
            stats.structured_output_compile_seconds = compile_seconds
        return stats

    def shutdown(self) -> None:
        """Release the executor's runners and workers; the engine core is not used after this."""
        self.structured_outputs.shutdown()
        self.executor.shutdown()


def can_speculate(request: Request) -> bool:
    """Whether the rejection sampler can verify proposals for ``request``: it applies temperature, top-k,
    top-p and min-p only, so requests with penalties, logit bias, allowed or banned tokens or a pending
    ``min_tokens`` decode one token per step (logprobs are the target's at each output position). A
    structured-output request speculates once its constraint is on (compiled, past any reasoning): its
    proposals are cut at the first token the grammar refuses, and each verified position is masked by the
    grammar as it stands after the proposals before."""
    params = request.sampling_params
    structured = request.structured_output
    return (not params.has_penalties and params.logit_bias is None
            and params.allowed_token_ids is None and not request.bad_words_token_ids
            and request.num_output_tokens >= params.min_tokens and (structured is None or structured.is_active))
