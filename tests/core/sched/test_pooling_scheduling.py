"""Pooling requests in the scheduler: prefill only, finished by their vector; encoders' whole prompts."""

import numpy as np

from quire.core.pooling_params import PoolingParams
from quire.core.request import FinishReason, Request
from quire.core.sampling_params import SamplingParams
from quire.core.sched.output import ModelRunnerOutput
from tests.core.sched.helpers import make_scheduler


def pooling_request(request_id: str, num_tokens: int) -> Request:
    return Request(request_id, list(range(100, 100 + num_tokens)), SamplingParams(max_tokens=1),
                   pooling_params=PoolingParams())


def pool_step(scheduler):
    """One step whose runner pools every request that reached the end of its prompt (as the real one)."""
    out = scheduler.schedule()
    pooled = {request_id: np.full(3, len(scheduler.requests[request_id].prompt_token_ids), dtype=np.float32)
              for request_id in out.num_scheduled_tokens
              if scheduler.requests[request_id].num_computed_tokens == scheduler.requests[request_id].num_tokens}
    return out, scheduler.update_from_output(out, ModelRunnerOutput({}, pooled=pooled))


def test_a_pooling_request_finishes_with_its_vector_after_its_prompt():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    scheduler.add_request(pooling_request("a", 10))
    scheduler.add_request(pooling_request("b", 20))
    out, outputs = pool_step(scheduler)
    assert out.num_scheduled_tokens == {"a": 10, "b": 6}  # chunked prefill, as for any causal prompt
    assert out.new_requests[0].pooling_params == PoolingParams()
    (a,) = outputs
    assert (a.request_id, a.new_token_ids, a.finish_reason) == ("a", [], FinishReason.STOP)
    assert a.pooling_output.to_array().tolist() == [10.0, 10.0, 10.0]
    out, outputs = pool_step(scheduler)
    assert out.num_scheduled_tokens == {"b": 14} and out.finished_request_ids == {"a"}
    assert [o.request_id for o in outputs] == ["b"] and outputs[0].pooling_output.shape == [3]
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.block_pool.num_blocks - 1


def test_whole_prompts_wait_for_a_step_with_room_for_all_of_them():
    scheduler = make_scheduler(max_num_batched_tokens=16, whole_prompts=True, long_prefill_token_threshold=4)
    for name, num_tokens in (("a", 10), ("b", 10), ("c", 5)):
        scheduler.add_request(pooling_request(name, num_tokens))
    out, outputs = pool_step(scheduler)
    assert out.num_scheduled_tokens == {"a": 10}  # b does not fit whole, and c waits behind it (FCFS)
    out, outputs = pool_step(scheduler)
    assert out.num_scheduled_tokens == {"b": 10, "c": 5}
    assert sorted(o.request_id for o in outputs) == ["b", "c"]
