"""``EngineCore``: the scheduler and the model runner driven one step at a time (no sockets here)."""

from __future__ import annotations

import logging
import time

from quire.core.config import EngineConfig
from quire.core.request import Request, RequestStatus
from quire.core.sched.kv_cache_manager import KVCacheManager
from quire.core.sched.scheduler import Scheduler
from quire.core.wire import EngineCoreOutputs, EngineCoreRequest
from quire.core.worker.kv_cache import num_kv_blocks

logger = logging.getLogger(__name__)


class EngineCore:
    """Loads the model, sizes the KV cache, and runs schedule → execute → update."""

    def __init__(self, config: EngineConfig):
        from quire.core.worker.model_runner import ModelRunner  # torch stays out of light imports

        self.config = config
        self.model_runner = ModelRunner(config)
        self.num_blocks = num_kv_blocks(config.model, config.cache, config.scheduler.max_num_seqs)
        self.model_runner.initialize_kv_cache(self.num_blocks)
        self.scheduler = Scheduler(
            config.scheduler,
            KVCacheManager(self.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching),
            config.model.max_model_len,
        )
        logger.info("engine ready: %s, %d KV blocks of %d tokens", config.model.architecture,
                    self.num_blocks, config.cache.block_size)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(Request(
            request.request_id, request.prompt_token_ids, request.sampling_params,
            tuple(request.eos_token_ids), request.arrival_time, request.priority,
            request.cache_salt, request.bad_words_token_ids,
        ))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while requests hold blocks."""
        return self.scheduler.reset_prefix_cache()

    def step(self) -> EngineCoreOutputs:
        """Run one engine step; with nothing to do, return empty outputs at once."""
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats(), timestamp=time.monotonic())
        scheduler_output = self.scheduler.schedule()
        runner_output = self.model_runner.execute(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.scheduler.make_stats(),
                                 timestamp=time.monotonic())
