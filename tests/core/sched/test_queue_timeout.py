"""max_queue_time: requests that wait too long before their first step finish with "queue_timeout"."""

from quire.core.request import FinishReason, RequestStatus
from tests.core.sched.helpers import make_request, make_scheduler, run_step


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_waiting_requests_past_the_limit_time_out_and_free_everything():
    clock = FakeClock()
    scheduler = make_scheduler(max_num_seqs=1, max_queue_time=5.0)
    scheduler.clock = clock
    scheduler.add_request(make_request("running", 4, arrival_time=100.0, max_tokens=50, ignore_eos=True))
    scheduler.add_request(make_request("late", 4, arrival_time=100.0))
    scheduler.add_request(make_request("fresh", 4, arrival_time=104.0))
    run_step(scheduler)  # "running" takes the only seat
    clock.now = 105.5  # "late" has waited 5.5 s, "fresh" 1.5 s
    out, outputs = run_step(scheduler)
    timed_out = [o for o in outputs if o.finish_reason == FinishReason.QUEUE_TIMEOUT]
    assert [o.request_id for o in timed_out] == ["late"]
    assert "max_queue_time=5" in timed_out[0].error_message and timed_out[0].new_token_ids == []
    assert "late" not in scheduler.requests and "late" in out.finished_request_ids  # the runner drops it
    assert [r.request_id for r in scheduler.waiting] == ["fresh"]
    clock.now = 200.0
    _, outputs = run_step(scheduler)
    assert [o.request_id for o in outputs if o.finish_reason == FinishReason.QUEUE_TIMEOUT] == ["fresh"]
    assert [r.request_id for r in scheduler.running] == ["running"]  # started requests never time out


def test_preempted_requests_are_exempt():
    clock = FakeClock()
    # two requests that cannot both keep growing in 6 blocks of 4 tokens: one gets preempted
    scheduler = make_scheduler(num_blocks=7, block_size=4, max_num_seqs=2, max_queue_time=1.0)
    scheduler.clock = clock
    for name in "ab":
        scheduler.add_request(make_request(name, 8, arrival_time=100.0, max_tokens=20, ignore_eos=True))
    for _ in range(12):
        clock.now += 0.5
        _, outputs = run_step(scheduler)
        assert all(o.finish_reason != FinishReason.QUEUE_TIMEOUT for o in outputs)
    assert scheduler.num_preemptions > 0
    assert all(r.status != RequestStatus.FINISHED_QUEUE_TIMEOUT for r in scheduler.requests.values())


def test_no_limit_by_default():
    clock = FakeClock()
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.clock = clock
    scheduler.add_request(make_request("a", 4, arrival_time=0.0, max_tokens=3))
    scheduler.add_request(make_request("b", 4, arrival_time=0.0, max_tokens=3))
    finished = set()
    for _ in range(10):
        _, outputs = run_step(scheduler)
        finished |= {o.request_id for o in outputs if o.finish_reason == FinishReason.LENGTH}
    assert finished == {"a", "b"}
