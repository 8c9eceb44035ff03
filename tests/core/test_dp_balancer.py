"""The data-parallel load balancer and the rules that combine engines' answers (pure Python, no engine)."""

import subprocess
import sys
from collections import Counter

import pytest

from quire.core.engine.core_client import UTILITY_METHODS
from quire.core.engine.dp_balancer import DataParallelBalancer
from quire.core.engine.dp_combine import COMBINE_RULES, combine_scheduler_stats, combine_utility_results
from quire.core.wire import EngineCoreOutput, EngineCoreOutputs, FinishReason, SchedulerStats


def report(balancer, engine, waiting=0, running=0, finished=()):
    outputs = [EngineCoreOutput(request_id, [1], FinishReason.STOP) for request_id in finished]
    balancer.record_outputs(EngineCoreOutputs(outputs, SchedulerStats(running, waiting), engine_index=engine))


def test_a_burst_before_any_report_alternates_between_engines():
    balancer = DataParallelBalancer(2)
    choices = [balancer.choose(f"r{i}") for i in range(40)]
    assert Counter(choices) == {0: 20, 1: 20}
    assert choices[:4] == [0, 1, 0, 1]
    three = DataParallelBalancer(3)
    assert [three.choose(f"r{i}") for i in range(6)] == [0, 1, 2, 0, 1, 2]


def test_the_lowest_load_wins_and_ties_rotate():
    balancer = DataParallelBalancer(3)
    for i in range(6):
        balancer.choose(f"r{i}")  # two each
    report(balancer, 0, waiting=1, running=1)
    report(balancer, 1, running=2)
    report(balancer, 2, running=1, finished=["r2"])  # engine 2 finished one of its two
    assert [balancer.load(engine) for engine in range(3)] == [2, 2, 1]
    assert balancer.choose("a") == 2
    # now all three hold two: the rotation goes on past the engine chosen last
    assert [balancer.choose(name) for name in ("b", "c", "d")] == [0, 1, 2]


def test_reports_replace_the_requests_sent_since_the_last_one():
    balancer = DataParallelBalancer(2)
    for i in range(4):
        balancer.choose(f"r{i}", pinned_engine=0)
    assert balancer.load(0) == 4
    report(balancer, 0, waiting=1, running=2)  # the report counts what it saw: 3 of the 4
    assert balancer.load(0) == 3
    balancer.choose("r4", pinned_engine=0)
    assert balancer.load(0) == 4  # the report's 3 plus 1 sent since
    report(balancer, 0, running=4)
    assert balancer.load(0) == 4


def test_pinned_requests_go_to_their_engine_and_count_in_its_load():
    balancer = DataParallelBalancer(2)
    assert [balancer.choose(f"p{i}", pinned_engine=1) for i in range(3)] == [1, 1, 1]
    assert balancer.load(1) == 3 and balancer.engine_of("p2") == 1
    assert [balancer.choose(f"r{i}") for i in range(3)] == [0, 0, 0]  # engine 0 was idle
    with pytest.raises(ValueError):
        balancer.choose("x", pinned_engine=2)


def test_finished_and_aborted_requests_are_forgotten():
    balancer = DataParallelBalancer(2)
    for i in range(4):
        balancer.choose(f"r{i}")  # r0, r2 -> engine 0; r1, r3 -> engine 1
    report(balancer, 0, running=1, finished=["r0"])
    assert balancer.engine_of("r0") is None and balancer.engine_of("r2") == 0
    assert balancer.forget(["r1", "r2", "r3", "r0", "unknown"]) == {1: ["r1", "r3"], 0: ["r2"]}
    assert balancer.num_tracked_requests == 0
    assert balancer.forget(["r1"]) == {}
    # an idle engine sends no report after an abort: its stale count is capped by what is in flight
    assert balancer.load(0) == 0 and balancer.load(1) == 0


def test_every_utility_method_has_a_combine_rule():
    assert set(COMBINE_RULES) == UTILITY_METHODS
    assert combine_utility_results("reset_prefix_cache", [True, True]) is True
    assert combine_utility_results("reset_prefix_cache", [True, False]) is False
    assert combine_utility_results("check_idle_invariants", [True, True]) is True
    timings = combine_utility_results("get_step_timings", [{"num_steps": 3, "forward": 0.5},
                                                           {"num_steps": 1, "forward": 0.25}])
    assert timings == {"num_steps": 4, "forward": 0.75}
    engines = [{"num_running_reqs": 1, "kv_cache_usage": 0.5, "num_blocks": 10, "num_threads": 1,
                "structured_output_compile_seconds": [0.1]},
               {"num_running_reqs": 2, "kv_cache_usage": 0.0, "num_blocks": 30, "num_threads": 1,
                "structured_output_compile_seconds": []}]
    stats = combine_utility_results("get_stats", engines)
    assert stats["num_running_reqs"] == 3 and stats["num_blocks"] == 40 and stats["num_threads"] == 2
    assert stats["kv_cache_usage"] == pytest.approx(0.125)  # 5 of 40 blocks
    assert stats["structured_output_compile_seconds"] == [0.1] and stats["engines"] == engines


def test_the_group_scheduler_stats_sum_each_engine_latest_snapshot():
    first = SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.5, num_preemptions=3,
                           prefix_cache_hits=10, structured_output_compile_seconds=[0.2],
                           spec_decode_num_accepted_tokens=5, spec_decode_num_accepted_tokens_per_pos=[3, 2])
    second = SchedulerStats(num_running_reqs=1, kv_cache_usage=1.0, prefix_cache_hits=5,
                            spec_decode_num_accepted_tokens=6, spec_decode_num_accepted_tokens_per_pos=[3, 2, 1])
    assert combine_scheduler_stats([first, None], first, [10, 10]) == first
    combined = combine_scheduler_stats([first, second], second, [10, 30])
    assert (combined.num_running_reqs, combined.num_waiting_reqs) == (3, 1)
    assert (combined.num_preemptions, combined.prefix_cache_hits) == (3, 15)
    assert combined.kv_cache_usage == pytest.approx(35 / 40)
    assert combined.structured_output_compile_seconds == []  # only the incoming snapshot's own
    assert combined.spec_decode_num_accepted_tokens == 11
    assert combined.spec_decode_num_accepted_tokens_per_pos == [6, 4, 1]  # added position by position


def test_the_balancer_and_the_combine_rules_import_no_torch():
    code = ("import sys; import quire.core.engine.dp_balancer, quire.core.engine.dp_combine; "
            "assert 'torch' not in sys.modules and 'zmq' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
