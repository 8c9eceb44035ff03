"""Continuous batching under a token budget.

There is no prefill phase and no decode phase: every request has ``num_computed_tokens`` and each step
hands out tokens so that it catches up with the request's known tokens. One rule covers chunked prefill,
prefix-cache hits, resumption after preemption and decode in the same batch. Running requests are served
first; waiting requests are admitted only if no request was preempted in this step. When KV blocks run
out, a running request chosen by the policy (FCFS: the latest admitted; priority: the lowest priority)
is preempted by recompute: its blocks are freed and it goes back to the waiting queue.

A prompt's images (``mm_features``) need their encoder outputs when their placeholder tokens are scheduled:
the encoder cache (``EncoderCacheManager``) says which are held, and each step encodes at most a budget of
placeholder tokens, so a burst of large images cannot blow one step's memory; a request whose next image
does not fit computes up to it and waits. Chunks may end inside an image's placeholders.

A request with a structured-output constraint waits apart (``waiting_for_grammar``) until its grammar
has compiled, then joins the waiting queue in arrival order; nobody else waits for it. Each sampled token
advances its grammar, and a terminated grammar finishes the request (``stop``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from quire.core.config import SchedulerConfig
from quire.core.request import Request, RequestStatus
from quire.core.sched.encoder_cache import EncoderCacheManager
from quire.core.sched.kv_cache_manager import KVCacheManager
from quire.core.sched.output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from quire.core.sched.request_queue import make_request_queue
from quire.core.sched.stop import check_stop
from quire.core.wire import EngineCoreOutput, EventType, SchedulerStats, TensorData


class Scheduler:
    """Owns the waiting queue, the running list and every request's KV blocks."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, max_model_len: int,
                 clock: Callable[[], float] = time.time, max_loras: int | None = None):
        self.config = config
        self.max_loras = max_loras  # with LoRA: most distinct adapters among the running requests
        self.clock = clock  # the clock of Request.arrival_time (wall time, shared by the processes)
        self.kv_cache_manager = kv_cache_manager
        # encoder outputs held by the runner, in placeholder tokens (an item alone may exceed it)
        self.encoder_cache = EncoderCacheManager(config.max_num_batched_tokens)
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting = make_request_queue(config.policy)
        self.running: list[Request] = []
        self.waiting_for_grammar: list[Request] = []
        self._removed_request_ids: set[str] = set()
        self.num_preemptions = 0
        self.spec_decode_counts = SpecDecodeCounts()
        self._last_num_scheduled_tokens = 0
        self._early_outputs: list[EngineCoreOutput] = []  # requests finished before any step ran them

    # -- requests in and out ------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        self.requests[request.request_id] = request
        request.record_event(EventType.QUEUED)
        if request.structured_output is not None and not request.structured_output.is_ready():
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.waiting_for_grammar.append(request)
        else:
            self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        if request.structured_output is not None and request.structured_output.error is not None:
            self.requests.pop(request.request_id)
            request.status = RequestStatus.FINISHED_ERROR
            self._removed_request_ids.add(request.request_id)
            self._early_outputs.append(EngineCoreOutput(
                request.request_id, [], request.status.finish_reason, events=request.take_events(),
                error_message=request.structured_output.error))
            return
        request.status = RequestStatus.WAITING
        self.waiting.add(request)

    def _admit_compiled(self) -> None:
        """Move requests whose grammar is ready (or failed) from ``waiting_for_grammar`` on."""
        still_compiling = []
        for request in self.waiting_for_grammar:
            if request.structured_output.is_ready():
                self._enqueue(request)
            else:
                still_compiling.append(request)
        self.waiting_for_grammar = still_compiling

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (abort); unknown or already finished ids are ignored."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_GRAMMAR:
                self.waiting_for_grammar.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_grammar)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.waiting_for_grammar)

    @property
    def only_compiling(self) -> bool:
        """Every unfinished request waits for its grammar: a step has nothing to run."""
        return bool(self.waiting_for_grammar) and not (self.waiting or self.running)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    # -- one step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        if self.waiting_for_grammar:
            self._admit_compiled()
        if self.config.max_queue_time is not None:
            self._expire_waiting(self.clock() - self.config.max_queue_time)
        step = _StepPlan(self.config.max_num_batched_tokens)
        self._schedule_running(step)
        if not step.preempted:
            self._schedule_waiting(step)
        for request_id, num_tokens in step.num_scheduled.items():
            request = self.requests[request_id]
            request.num_computed_tokens += num_tokens
            request.spec_token_ids = []  # consumed: the next proposal follows this step's outcome
            for feature in request.mm_features:  # computed into the KV cache: the output may go
                if feature.offset + feature.length <= request.num_computed_tokens:
                    self.encoder_cache.release(request, feature.identifier)
        self._last_num_scheduled_tokens = step.total
        return SchedulerOutput(step.new, list(step.cached.values()), step.num_scheduled,
                               self.take_removed_request_ids(), scheduled_encoder_inputs=step.encoder_inputs,
                               freed_encoder_identifiers=self.encoder_cache.take_freed(),
                               scheduled_spec_decode_tokens=step.spec_tokens)

    def take_removed_request_ids(self) -> set[str]:
        """Ids finished or preempted since the last call, which the model runner must drop."""
        removed, self._removed_request_ids = self._removed_request_ids, set()
        return removed

    def _expire_waiting(self, oldest_allowed: float) -> None:
        expired = [r for r in self.waiting if r.status == RequestStatus.WAITING and r.arrival_time < oldest_allowed]
        for request in expired:
            self.waiting.remove(request)
            request.status = RequestStatus.FINISHED_QUEUE_TIMEOUT
            self._free(request)
            self._early_outputs.append(EngineCoreOutput(
                request.request_id, [], request.status.finish_reason, events=request.take_events(),
                error_message=f"the request waited more than max_queue_time={self.config.max_queue_time:g} s "
                              "for its first step"))

    def _schedule_running(self, step: _StepPlan) -> None:
        index = 0
        while index < len(self.running) and step.budget > 0:
            request = self.running[index]
            num_new_tokens = self._num_new_tokens(request, step.budget, num_spec=self._num_spec_tokens(request))
            num_without_spec = min(num_new_tokens, request.num_tokens - request.num_computed_tokens)
            encoder_plan = None
            if request.mm_features and num_new_tokens > 0:
                num_new_tokens, encoder_plan = self._plan_encoder_inputs(
                    request, request.num_computed_tokens, num_new_tokens, step)
            if num_new_tokens <= 0:
                index += 1
                continue
            while (block_ids := self.kv_cache_manager.allocate_slots(request, num_new_tokens)) is None:
                if num_new_tokens > num_without_spec:
                    num_new_tokens = num_without_spec  # a proposal never costs another request its blocks
                    continue
                victim = self.waiting.select_victim(self.running)
                if self.running.index(victim) < index:
                    index -= 1
                self._preempt(victim, step)
                if victim is request:
                    break
            if block_ids is None:
                continue  # the request preempted itself; `index` now points at its successor
            if encoder_plan is not None:
                self._commit_encoder_inputs(request, encoder_plan, step)
            step.cached[request.request_id] = CachedRequestData(
                request.request_id, block_ids, request.num_computed_tokens,
                self.kv_cache_manager.num_released_blocks(request.request_id))
            step.add(request.request_id, num_new_tokens)
            num_spec = request.num_computed_tokens + num_new_tokens - request.num_tokens
            if num_spec > 0:
                step.spec_tokens[request.request_id] = request.spec_token_ids[:num_spec]
            index += 1

    def _schedule_waiting(self, step: _StepPlan) -> None:
        while self.waiting and step.budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            computed_blocks, num_cached = [], 0
            if request.num_computed_tokens == 0:
                computed_blocks, num_cached = self.kv_cache_manager.get_computed_blocks(request)
            num_new_tokens = self._num_new_tokens(request, step.budget, num_cached)
            if self.config.whole_prompts and num_new_tokens < request.num_tokens - request.num_computed_tokens:
                break  # an encoder's prompt runs whole: it waits for a step with room for all of it
            if not self._adapter_fits(request):
                break  # its adapter waits for a running one to finish
            encoder_plan = None
            if request.mm_features:
                num_new_tokens, encoder_plan = self._plan_encoder_inputs(
                    request, request.num_computed_tokens + num_cached, num_new_tokens, step)
                if num_new_tokens <= 0:
                    break  # its next image does not fit in this step's encoder budget
            if self.kv_cache_manager.allocate_slots(request, num_new_tokens, computed_blocks) is None:
                break
            if encoder_plan is not None:
                self._commit_encoder_inputs(request, encoder_plan, step)
            self.waiting.pop()
            if request.num_computed_tokens == 0 and not request.skip_prefix_cache:
                self.kv_cache_manager.record_lookup(request.num_tokens, num_cached)
            request.num_computed_tokens += num_cached
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            request.record_event(EventType.SCHEDULED)
            self.running.append(request)
            step.new.append(NewRequestData(
                request_id=request.request_id,
                token_ids=list(request.all_token_ids),
                num_prompt_tokens=request.num_prompt_tokens,
                sampling_params=request.sampling_params,
                eos_token_ids=sorted(request.eos_token_ids),
                bad_words_token_ids=request.bad_words_token_ids,
                block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                num_computed_tokens=request.num_computed_tokens,
                mm_features=request.mm_features,
                lora_request=request.lora_request,
                pooling_params=request.pooling_params,
            ))
            step.add(request.request_id, num_new_tokens)

    def _adapter_fits(self, request: Request) -> bool:
        """With LoRA: a request whose adapter is not running yet starts only while fewer than ``max_loras``
        adapters run (every running request may be scheduled in one step)."""
        adapter = request.lora_request
        if adapter is None or self.max_loras is None:
            return True
        running = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
        return adapter.lora_int_id in running or len(running) < self.max_loras

    def _num_spec_tokens(self, request: Request) -> int:
        """How many of the request's proposed tokens it may verify in this step: none before its prompt is
        computed, and none that its ``max_tokens`` or the model's length leaves no room for (the step
        also samples one token past the accepted ones)."""
        if not request.spec_token_ids or request.num_tokens - request.num_computed_tokens != 1:
            return 0
        room = self.max_model_len - request.num_tokens
        if request.sampling_params.max_tokens is not None:
            room = min(room, request.sampling_params.max_tokens - request.num_output_tokens)
        room -= 1
        return max(0, min(len(request.spec_token_ids), room))

    def _num_new_tokens(self, request: Request, budget: int, num_cached: int = 0, num_spec: int = 0) -> int:
        num_new_tokens = min(request.num_tokens + num_spec - request.num_computed_tokens - num_cached, budget)
        threshold = self.config.long_prefill_token_threshold
        if threshold and self.num_unfinished_requests > 1 and not self.config.whole_prompts:
            num_new_tokens = min(num_new_tokens, threshold)
        return num_new_tokens

    def _plan_encoder_inputs(self, request: Request, num_computed: int, num_new_tokens: int,
                             step: _StepPlan) -> tuple[int, tuple[list[str], list[int]]]:
        """The tokens the request may compute given its images, with the cached outputs it takes (hits) and
        the items to encode in this step; nothing is committed. An image that neither is cached nor fits
        the step's encoder budget and the encoder cache cuts the tokens short before it."""
        cache = self.encoder_cache
        hits, to_encode = [], []
        budget, size = step.encoder_budget, 0
        end = num_computed + num_new_tokens
        for index, feature in enumerate(request.mm_features):
            if feature.offset >= end:
                break
            identifier = feature.identifier
            if (feature.offset + feature.length <= num_computed or cache.is_referenced_by(request, identifier)
                    or identifier in hits or any(request.mm_features[i].identifier == identifier for i in to_encode)):
                continue  # computed already, held for this request, or taken earlier in this plan
            if cache.is_cached(identifier):
                hits.append(identifier)
                continue
            fits = feature.length <= budget or not (step.encoder_inputs or to_encode)
            if not (fits and cache.can_allocate(size + feature.length)):
                return feature.offset - num_computed, (hits, to_encode)
            to_encode.append(index)
            budget -= feature.length
            size += feature.length
        return num_new_tokens, (hits, to_encode)

    def _commit_encoder_inputs(self, request: Request, plan: tuple[list[str], list[int]], step: _StepPlan) -> None:
        hits, to_encode = plan
        for identifier in hits:
            self.encoder_cache.take_hit(request, identifier)
        for index in to_encode:
            feature = request.mm_features[index]
            self.encoder_cache.allocate(request, feature.identifier, feature.length)
            step.encoder_budget -= feature.length
        if to_encode:
            step.encoder_inputs[request.request_id] = to_encode

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, decide stops, free finished requests; return per-request outputs (and
        those of requests that timed out in the queue during ``schedule``)."""
        outputs, self._early_outputs = self._early_outputs, []
        for request_id, vector in runner_output.pooled.items():
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue  # aborted while the step ran
            request.status = RequestStatus.FINISHED_STOPPED
            self.running.remove(request)
            self._free(request)
            outputs.append(EngineCoreOutput(
                request_id, [], request.status.finish_reason, num_cached_tokens=request.num_cached_tokens or 0,
                events=request.take_events(), pooling_output=TensorData.from_array(vector)))
        for request_id, token_ids in runner_output.sampled_token_ids.items():
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue  # aborted while the step ran
            spec_tokens = scheduler_output.scheduled_spec_decode_tokens.get(request_id)
            if spec_tokens:
                # the KV of the rejected proposals is not the request's: recompute from the last accepted one
                request.num_computed_tokens -= len(spec_tokens) + 1 - len(token_ids)
                self.spec_decode_counts.record(len(spec_tokens), len(token_ids) - 1)
            new_token_ids = []
            for token_id in token_ids:
                request.append_output_token(token_id)
                new_token_ids.append(token_id)
                if check_stop(request, self.max_model_len) or (
                        request.structured_output is not None and _advance_grammar(request, token_id)):
                    break
            if request.is_finished:
                self.running.remove(request)
                self._free(request)
            outputs.append(EngineCoreOutput(
                request_id, new_token_ids, request.status.finish_reason, request.stop_reason,
                num_cached_tokens=request.num_cached_tokens or 0, error_message=request.error_message,
                new_logprobs=runner_output.logprobs.get(request_id),
                new_prompt_logprobs=runner_output.prompt_logprobs.get(request_id),
                events=request.take_events(),
            ))
        for request_id, prompt_logprobs in runner_output.prompt_logprobs.items():
            request = self.requests.get(request_id)
            if request_id not in runner_output.sampled_token_ids and request is not None:
                # a prompt chunk that sampled nothing yet: its prompt logprobs go out now
                outputs.append(EngineCoreOutput(request_id, [], new_prompt_logprobs=prompt_logprobs,
                                                events=request.take_events()))
        return outputs

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.waiting_for_grammar),
            kv_cache_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks,
            num_preemptions=self.num_preemptions,
            num_scheduled_tokens=self._last_num_scheduled_tokens,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            mm_cache_queries=self.encoder_cache.num_queries,
            mm_cache_hits=self.encoder_cache.num_hits,
            spec_decode_num_drafts=self.spec_decode_counts.num_drafts,
            spec_decode_num_draft_tokens=self.spec_decode_counts.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec_decode_counts.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(self.spec_decode_counts.num_accepted_tokens_per_pos),
            max_loras=self.max_loras or 0,
            running_lora_adapters=_adapter_names(self.running) if self.max_loras else [],
            waiting_lora_adapters=_adapter_names(self.waiting) if self.max_loras else [],
        )

    # -- helpers -----------------------------------------------------------------------------

    def _preempt(self, request: Request, step: _StepPlan) -> None:
        self.running.remove(request)
        not_encoded = step.unschedule(request.request_id)
        self.kv_cache_manager.free(request)
        self.encoder_cache.release_all(request)
        for index in not_encoded:  # allocated for this step, which no longer runs the encoder for them
            self.encoder_cache.forget(request.mm_features[index].identifier)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        request.record_event(EventType.PREEMPTED)
        self.num_preemptions += 1
        self.waiting.add_preempted(request)
        self._removed_request_ids.add(request.request_id)

    def _free(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.encoder_cache.release_all(request)
        del self.requests[request.request_id]
        self._removed_request_ids.add(request.request_id)


def _advance_grammar(request: Request, token_id: int) -> bool:
    """Feed a token to the request's grammar; finish the request (and return True) if the grammar refuses
    the token (an error: the mask allowed nothing the sampler could pick) or has terminated."""
    structured = request.structured_output
    if not structured.accept(token_id):
        request.status = RequestStatus.FINISHED_ERROR
        request.error_message = (f"token {token_id} is not allowed by the request's structured-output constraint "
                                 "(other parameters, e.g. min_tokens or bad_words, may conflict with it)")
        return True
    if structured.is_terminated():
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    return False


class SpecDecodeCounts:
    """Speculative decoding so far: verification steps (drafts), proposed and accepted tokens, and how often
    the token at each proposal position was accepted."""

    def __init__(self):
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos: list[int] = []

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        missing = num_draft_tokens - len(self.num_accepted_tokens_per_pos)
        if missing > 0:
            self.num_accepted_tokens_per_pos.extend([0] * missing)
        for position in range(num_accepted):
            self.num_accepted_tokens_per_pos[position] += 1


class _StepPlan:
    """What one ``schedule()`` call has decided so far."""

    def __init__(self, budget: int):
        self.budget = budget
        self.total = 0
        self.num_scheduled: dict[str, int] = {}
        self.cached: dict[str, CachedRequestData] = {}
        self.new: list[NewRequestData] = []
        self.preempted = False
        self.encoder_budget = budget  # placeholder tokens the encoder may process in this step
        self.encoder_inputs: dict[str, list[int]] = {}
        self.spec_tokens: dict[str, list[int]] = {}

    def add(self, request_id: str, num_tokens: int) -> None:
        self.num_scheduled[request_id] = num_tokens
        self.budget -= num_tokens
        self.total += num_tokens

    def unschedule(self, request_id: str) -> list[int]:
        """Forget a request preempted after it was scheduled (possible under the priority policy); return
        the items it was to encode."""
        self.preempted = True
        num_tokens = self.num_scheduled.pop(request_id, 0)
        self.cached.pop(request_id, None)
        self.spec_tokens.pop(request_id, None)
        self.budget += num_tokens
        self.total -= num_tokens
        return self.encoder_inputs.pop(request_id, [])


def _adapter_names(requests) -> list[str]:
    return sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None})
