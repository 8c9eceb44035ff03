"""Continuous batching under a token budget.

There is no prefill phase and no decode phase: every request has ``num_computed_tokens`` and each step
hands out tokens so that it catches up with the request's known tokens. One rule covers chunked prefill,
resumption after preemption and decode in the same batch. Running requests are served first; waiting
requests are admitted only if no request was preempted in this step. When KV blocks run out, the
latest-admitted running request is preempted by recompute: its blocks are freed and it goes back to the
head of the waiting queue.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from quire.core.config import SchedulerConfig
from quire.core.request import Request, RequestStatus
from quire.core.sched.kv_cache_manager import KVCacheManager
from quire.core.sched.output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from quire.core.sched.stop import check_stop
from quire.core.wire import EngineCoreOutput, SchedulerStats


class Scheduler:
    """Owns the waiting queue, the running list and every request's KV blocks."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, max_model_len: int):
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._removed_request_ids: set[str] = set()
        self.num_preemptions = 0
        self._last_num_scheduled_tokens = 0

    # -- requests in and out ------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (abort); unknown or already finished ids are ignored."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            finished.append(request)
        for request in finished:
            self._free(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- one step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        cached: list[CachedRequestData] = []
        new: list[NewRequestData] = []
        preempted = False

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new_tokens <= 0:
                index += 1
                continue
            block_ids, preempted_now = self._allocate_or_preempt(request, num_new_tokens)
            preempted = preempted or preempted_now
            if block_ids is None:
                break  # the request preempted itself: nothing later in the list can run either
            cached.append(CachedRequestData(request.request_id, block_ids, request.num_computed_tokens))
            num_scheduled[request.request_id] = num_new_tokens
            budget -= num_new_tokens
            index += 1

        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            if self.kv_cache_manager.allocate_slots(request, num_new_tokens) is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            new.append(NewRequestData(
                request_id=request.request_id,
                token_ids=list(request.all_token_ids),
                num_prompt_tokens=request.num_prompt_tokens,
                sampling_params=request.sampling_params,
                eos_token_ids=sorted(request.eos_token_ids),
                block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                num_computed_tokens=request.num_computed_tokens,
            ))
            num_scheduled[request.request_id] = num_new_tokens
            budget -= num_new_tokens

        for request_id, num_tokens in num_scheduled.items():
            self.requests[request_id].num_computed_tokens += num_tokens
        removed, self._removed_request_ids = self._removed_request_ids, set()
        self._last_num_scheduled_tokens = sum(num_scheduled.values())
        return SchedulerOutput(new, cached, num_scheduled, removed)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, decide stops, free finished requests; return per-request outputs."""
        outputs = []
        for request_id, token_ids in runner_output.sampled_token_ids.items():
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue  # aborted while the step ran
            new_token_ids = []
            for token_id in token_ids:
                request.append_output_token(token_id)
                new_token_ids.append(token_id)
                if check_stop(request, self.max_model_len):
                    break
            if request.is_finished:
                self.running.remove(request)
                self._free(request)
            outputs.append(EngineCoreOutput(
                request_id, new_token_ids, request.status.finish_reason, request.stop_reason
            ))
        return outputs

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            num_free_blocks=self.kv_cache_manager.num_free_blocks,
            num_preemptions=self.num_preemptions,
            num_scheduled_tokens=self._last_num_scheduled_tokens,
        )

    # -- helpers -----------------------------------------------------------------------------

    def _allocate_or_preempt(self, request: Request, num_new_tokens: int) -> tuple[list[int] | None, bool]:
        """Allocate slots, preempting from the back of the running list until they fit.

        Returns ``(new block ids or None if ``request`` itself was preempted, whether anything was)``.
        """
        preempted = False
        while True:
            block_ids = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            if block_ids is not None:
                return block_ids, preempted
            victim = self.running.pop()
            self._preempt(victim)
            preempted = True
            if victim is request:
                return None, preempted

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        self._removed_request_ids.add(request.request_id)

    def _free(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._removed_request_ids.add(request.request_id)
