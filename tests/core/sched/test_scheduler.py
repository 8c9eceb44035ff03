from quire.core.request import FinishReason, RequestStatus
from quire.core.sched.output import ModelRunnerOutput
from tests.core.sched.helpers import EOS, make_request, make_scheduler, run_step


def test_prompts_are_chunked_under_the_token_budget_then_decode_together():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    scheduler.add_request(make_request("a", 10))
    scheduler.add_request(make_request("b", 20))
    out, outputs = run_step(scheduler)
    assert out.num_scheduled_tokens == {"a": 10, "b": 6}
    assert [o.request_id for o in outputs] == ["a"]  # b's chunk did not reach its end: no token
    out, outputs = run_step(scheduler)
    assert out.num_scheduled_tokens == {"a": 1, "b": 14}
    assert [o.request_id for o in outputs] == ["a", "b"]
    out, _ = run_step(scheduler)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}


def test_new_request_data_carries_blocks_and_progress():
    scheduler = make_scheduler(block_size=4, max_num_batched_tokens=6)
    scheduler.add_request(make_request("a", 10))
    out, _ = run_step(scheduler)
    (new,) = out.new_requests
    assert new.request_id == "a" and new.num_computed_tokens == 0 and len(new.block_ids) == 2
    assert new.token_ids == list(range(100, 110)) and new.eos_token_ids == [EOS]
    out, _ = run_step(scheduler)
    (cached,) = out.cached_requests
    assert cached.num_computed_tokens == 6 and len(cached.new_block_ids) == 1


def test_max_num_seqs_caps_running_requests():
    scheduler = make_scheduler(max_num_seqs=2)
    for name in "abc":
        scheduler.add_request(make_request(name, 4))
    out, _ = run_step(scheduler)
    assert set(out.num_scheduled_tokens) == {"a", "b"}
    assert [r.request_id for r in scheduler.waiting] == ["c"]


def test_preemption_takes_the_latest_admitted_and_requeues_it_first():
    # 6 usable blocks of 4 tokens; two 8-token prompts take 4 blocks; decoding needs more.
    scheduler = make_scheduler(num_blocks=7, block_size=4, max_num_batched_tokens=64)
    scheduler.add_request(make_request("a", 8, max_tokens=20))
    scheduler.add_request(make_request("b", 8, max_tokens=20))
    scheduler.add_request(make_request("c", 3, max_tokens=20))
    preempted_at = None
    for step in range(12):
        out, _ = run_step(scheduler)
        if scheduler.num_preemptions and preempted_at is None:
            preempted_at = step
            victim = next(r for r in scheduler.waiting if r.status == RequestStatus.PREEMPTED)
            assert victim.request_id == "c"  # admitted last
            assert victim.num_computed_tokens == 0 and victim.num_preemptions == 1
            assert scheduler.waiting.peek() is victim
            assert "c" not in out.num_scheduled_tokens
    assert preempted_at is not None


def test_preempted_request_resumes_with_all_its_tokens():
    scheduler = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64)  # 4 usable
    scheduler.add_request(make_request("a", 7, max_tokens=10))
    scheduler.add_request(make_request("b", 7, max_tokens=10))
    removed, resumed = set(), None
    for _ in range(30):
        out, _ = run_step(scheduler)
        removed |= out.finished_request_ids
        for new in out.new_requests:
            if new.request_id in removed:
                resumed = new
        if resumed:
            break
    assert resumed is not None, "expected a preempted request to be resumed"
    assert resumed.num_computed_tokens == 0
    assert len(resumed.token_ids) > resumed.num_prompt_tokens == 7  # prompt plus generated tokens


def test_no_waiting_request_is_admitted_in_a_step_that_preempted():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)  # 3 usable
    scheduler.add_request(make_request("a", 4, max_tokens=20))
    scheduler.add_request(make_request("b", 4, max_tokens=20))
    run_step(scheduler)  # a: 1 block, b: 1 block
    scheduler.add_request(make_request("late", 1, max_tokens=1))
    for _ in range(10):
        before = scheduler.num_preemptions
        out, _ = run_step(scheduler)
        if scheduler.num_preemptions > before:
            assert not any(n.request_id == "late" for n in out.new_requests)
            return
    raise AssertionError("no preemption happened")


def test_every_request_finishes_and_all_blocks_return_under_pressure():
    scheduler = make_scheduler(num_blocks=12, block_size=4, max_num_batched_tokens=32)
    for i in range(6):
        scheduler.add_request(make_request(str(i), 5 + 3 * i, max_tokens=9 + i))
    finished = {}
    for _ in range(500):
        if not scheduler.has_unfinished_requests():
            break
        _, outputs = run_step(scheduler)
        for output in outputs:
            if output.finished:
                finished[output.request_id] = output.finish_reason
    assert finished == {str(i): FinishReason.LENGTH for i in range(6)}
    assert scheduler.num_preemptions > 0
    assert scheduler.kv_cache_manager.num_free_blocks == 11
    assert scheduler.requests == {} and scheduler.kv_cache_manager.req_to_blocks == {}


def test_abort_frees_running_and_waiting_requests():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("run", 9))
    scheduler.add_request(make_request("wait", 9))
    run_step(scheduler)
    scheduler.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.num_free_blocks == 63
    out = scheduler.schedule()
    assert out.finished_request_ids == {"run", "wait"} and out.is_empty


def test_outputs_of_an_aborted_request_are_dropped():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 3))
    out = scheduler.schedule()
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.update_from_output(out, ModelRunnerOutput({"a": [5]})) == []
