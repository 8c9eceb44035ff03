"""AsyncLLM over the process boundary: concurrency, cancellation, admission, utilities."""

import asyncio
import random

import pytest

from quire.core import EngineClient, SamplingParams
from quire.core.errors import EngineUtilityError, OverloadedError, ValidationError
from quire.core.sampling_params import RequestOutputKind
from tests.core.engine_process.conftest import run

DELTA, FINAL = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY


async def count_tokens(engine, request_id, prompt, params):
    """Consume a request; return the number of tokens of each completion index."""
    counts = {}
    async for output in engine.generate(prompt, params, request_id):
        for completion in output.outputs:
            if params.output_kind == DELTA:
                counts[completion.index] = counts.get(completion.index, 0) + len(completion.token_ids)
            else:
                counts[completion.index] = len(completion.token_ids)
    return counts


def test_100_concurrent_requests_produce_exactly_their_max_tokens(make_async_llm):
    engine = make_async_llm(max_num_seqs=64)
    rng = random.Random(0)
    jobs = [(f"r{i}", f"value_{i} = ", rng.randint(1, 24), DELTA if i % 2 else FINAL) for i in range(100)]

    async def main():
        results = await asyncio.gather(*[
            count_tokens(engine, rid, prompt, SamplingParams(max_tokens=n, ignore_eos=True, output_kind=kind))
            for rid, prompt, n, kind in jobs])
        await engine.check_idle_invariants()
        return results

    results = run(main())
    assert [r[0] for r in results] == [n for _, _, n, _ in jobs]


def test_cancelling_a_third_leaves_the_rest_intact_and_frees_every_block(make_async_llm):
    engine = make_async_llm(max_num_seqs=32, faults="step_delay_ms=10")
    rng = random.Random(1)
    cancelled = set(rng.sample(range(60), 20))
    started = {i: asyncio.Event() for i in range(60)}

    async def consume(i):
        n = 3 if i % 7 == 0 else 1
        params = SamplingParams(n=n, temperature=1.0, seed=i, max_tokens=40, ignore_eos=True, output_kind=DELTA)
        counts = {}
        async for output in engine.generate(f"line {i}:", params, f"req-{i}"):
            started[i].set()
            for completion in output.outputs:
                counts[completion.index] = counts.get(completion.index, 0) + len(completion.token_ids)
        return counts

    async def main():
        tasks = {i: asyncio.create_task(consume(i)) for i in range(60)}
        for i in sorted(cancelled):
            await started[i].wait()  # in flight: it has produced tokens, and has many more to go
            tasks[i].cancel()
        results = {}
        for i, task in tasks.items():
            try:
                results[i] = await task
            except asyncio.CancelledError:
                assert i in cancelled
        assert set(results) == set(range(60)) - cancelled
        for i, counts in results.items():
            assert counts == {k: 40 for k in range(3 if i % 7 == 0 else 1)}
        for _ in range(50):  # aborts travel asynchronously: wait until the engine has them
            try:
                await engine.check_idle_invariants()
                break
            except EngineUtilityError:
                await asyncio.sleep(0.1)
        await engine.check_idle_invariants()
        # an aborted request's id can be used again
        reused = next(iter(cancelled))
        again = await count_tokens(engine, f"req-{reused}", "x",
                                   SamplingParams(max_tokens=3, ignore_eos=True, output_kind=DELTA))
        assert again == {0: 3}

    run(main())


def test_admission_limits_count_sequences(make_async_llm):
    engine = make_async_llm(max_num_queued_reqs=4, faults="step_delay_ms=20")
    params = SamplingParams(max_tokens=30, ignore_eos=True)

    async def in_flight(request_ids):
        """Start requests and return once each has produced output (30 tokens take >= 0.6 s)."""
        started = {rid: asyncio.Event() for rid in request_ids}

        async def consume(rid):
            tokens = 0
            async for output in engine.generate("x", params, rid):
                started[rid].set()
                tokens = len(output.outputs[0].token_ids)
            return tokens

        tasks = [asyncio.create_task(consume(rid)) for rid in request_ids]
        for event in started.values():
            await event.wait()
        return tasks

    async def main():
        first = await in_flight([f"a{i}" for i in range(4)])
        with pytest.raises(OverloadedError, match="limit is 4"):
            await count_tokens(engine, "fifth", "x", params)
        for task in first:
            task.cancel()
        await asyncio.gather(*first, return_exceptions=True)
        two = await in_flight(["b0", "b1"])
        with pytest.raises(OverloadedError):  # an n=3 request counts as 3: 2 + 3 > 4
            await count_tokens(engine, "n3", "x", SamplingParams(n=3, temperature=1.0, max_tokens=3))
        assert await asyncio.gather(*two) == [30, 30]

    run(main())


def test_explicit_abort_ends_the_stream_and_frees_the_request(make_async_llm):
    engine = make_async_llm(faults="step_delay_ms=5")

    async def main():
        outputs = []

        async def consume():
            async for output in engine.generate("x", SamplingParams(max_tokens=100, ignore_eos=True,
                                                                    output_kind=DELTA), "victim"):
                outputs.append(output)

        task = asyncio.create_task(consume())
        while not outputs:
            await asyncio.sleep(0.01)
        await engine.abort("victim")
        await asyncio.wait_for(task, 5)
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
        assert sum(len(o.outputs[0].token_ids) for o in outputs) < 100
        await engine.check_idle_invariants()  # the abort went first on the same socket

    run(main())


def test_validation_errors_and_utilities(make_async_llm):
    engine = make_async_llm()

    async def main():
        with pytest.raises(ValidationError) as info:
            await count_tokens(engine, "bad", "", SamplingParams())
        assert info.value.param == "prompt"
        await count_tokens(engine, "ok", "import os", SamplingParams(max_tokens=4))
        assert await engine.reset_prefix_cache() is True
        assert engine.get_metrics().scheduler is not None
        engine.check_health()
        assert engine.is_running and not engine.errored
        assert isinstance(engine, EngineClient)
        with pytest.raises(EngineUtilityError, match="unknown utility method"):  # the same type as in-process
            await engine.engine_core.call_utility_async("no_such_method")
        assert (await engine.get_debug_state())["front_end"] == {"tracked_requests": 0, "open_collectors": 0}
        assert (await engine.get_step_timings())["num_steps"] >= 1

    run(main())
