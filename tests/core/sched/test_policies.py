"""Priority scheduling and the long-prefill threshold."""

from quire.core.request import RequestStatus
from tests.core.sched.helpers import make_request, make_scheduler, run_step


def test_priority_policy_admits_the_lowest_value_first():
    scheduler = make_scheduler(max_num_seqs=1, policy="priority")
    scheduler.add_request(make_request("low", 4, priority=5, arrival_time=1.0))
    scheduler.add_request(make_request("high", 4, priority=0, arrival_time=2.0))
    scheduler.add_request(make_request("mid", 4, priority=1, arrival_time=3.0))
    out, _ = run_step(scheduler)
    assert list(out.num_scheduled_tokens) == ["high"]
    assert [r.request_id for r in scheduler.waiting] == ["mid", "low"]


def test_fcfs_ignores_priority():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("first", 4, priority=5))
    scheduler.add_request(make_request("second", 4, priority=0))
    out, _ = run_step(scheduler)
    assert list(out.num_scheduled_tokens) == ["first"]


def test_priority_preemption_takes_the_lowest_priority_running_request():
    # 4 usable blocks of 4 tokens; three requests fill them, then decoding needs more
    scheduler = make_scheduler(num_blocks=5, block_size=4, policy="priority")
    scheduler.add_request(make_request("urgent", 4, priority=0, arrival_time=3.0, max_tokens=20))
    scheduler.add_request(make_request("lazy", 4, priority=9, arrival_time=1.0, max_tokens=20))
    scheduler.add_request(make_request("normal", 4, priority=1, arrival_time=2.0, max_tokens=20))
    for _ in range(6):
        run_step(scheduler)
        if scheduler.num_preemptions:
            break
    preempted = [r.request_id for r in scheduler.waiting if r.status == RequestStatus.PREEMPTED]
    assert preempted == ["lazy"]


def test_long_prefill_threshold_keeps_decodes_moving():
    scheduler = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    scheduler.add_request(make_request("decoder", 2, max_tokens=20))
    run_step(scheduler)
    scheduler.add_request(make_request("long", 40))
    for expected_chunk in (8, 8, 8):
        out, _ = run_step(scheduler)
        assert out.num_scheduled_tokens == {"decoder": 1, "long": expected_chunk}


def test_long_prefill_threshold_does_not_slow_a_lone_request():
    scheduler = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    scheduler.add_request(make_request("alone", 40))
    out, _ = run_step(scheduler)
    assert out.num_scheduled_tokens == {"alone": 40}
