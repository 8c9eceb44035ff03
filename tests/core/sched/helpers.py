"""Builders for scheduler tests: requests, a scheduler, and a fake model runner."""

from quire.core.config import SchedulerConfig
from quire.core.request import Request
from quire.core.sampling_params import SamplingParams
from quire.core.sched.kv_cache_manager import KVCacheManager
from quire.core.sched.output import ModelRunnerOutput
from quire.core.sched.scheduler import Scheduler

EOS = 2


def make_request(request_id, num_prompt_tokens=None, *, prompt=None, priority=0, arrival_time=0.0,
                 cache_salt=None, **params):
    params.setdefault("max_tokens", 8)
    prompt = list(range(100, 100 + num_prompt_tokens)) if prompt is None else prompt
    return Request(request_id, prompt, SamplingParams(**params), eos_token_ids=(EOS,),
                   arrival_time=arrival_time, priority=priority, cache_salt=cache_salt)


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                   max_model_len=256, enable_caching=False, **config):
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             **config)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, enable_caching), max_model_len)


def fake_runner_output(scheduler, scheduler_output, token=7):
    """Sample ``token`` (an int, or a function of the request) for every request whose computed
    tokens caught up with its known tokens, as the real runner would."""
    sampled = {}
    for request_id in scheduler_output.num_scheduled_tokens:
        request = scheduler.requests[request_id]
        if request.num_computed_tokens == request.num_tokens:
            sampled[request_id] = [token(request) if callable(token) else token]
    return ModelRunnerOutput(sampled)


def run_step(scheduler, token=7):
    scheduler_output = scheduler.schedule()
    outputs = scheduler.update_from_output(scheduler_output,
                                           fake_runner_output(scheduler, scheduler_output, token))
    return scheduler_output, outputs
