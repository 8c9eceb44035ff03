"""The per-request collector merges deltas for a lagging consumer and keeps only the latest otherwise."""

import asyncio

import pytest

from quire.core.engine.output_collector import RequestOutputCollector
from quire.core.errors import EngineDeadError
from quire.core.outputs import CompletionOutput, RequestOutput
from quire.core.sampling_params import RequestOutputKind


def output(text, token_ids, index=0, finished=False):
    completion = CompletionOutput(index, text, token_ids, "length" if finished else None)
    return RequestOutput("r", None, [1], [completion], finished)


def test_deltas_merge_while_the_consumer_lags():
    collector = RequestOutputCollector(RequestOutputKind.DELTA)
    collector.put(output("Hel", [1]))
    collector.put(output("lo", [2]))
    collector.put(output("!", [3], index=1))
    collector.put(output(" you", [4, 5], finished=True))
    merged = collector.get_nowait()
    assert merged.finished
    assert [(c.index, c.text, c.token_ids) for c in merged.outputs] == [
        (0, "Hello you", [1, 2, 4, 5]), (1, "!", [3])]
    assert collector.get_nowait() is None


def test_cumulative_outputs_replace_each_other():
    collector = RequestOutputCollector(RequestOutputKind.CUMULATIVE)
    collector.put(output("a", [1]))
    collector.put(output("ab", [1, 2]))
    assert collector.get_nowait().outputs[0].text == "ab"


def test_an_error_wins_and_wakes_the_consumer():
    async def main():
        collector = RequestOutputCollector(RequestOutputKind.DELTA)
        waiter = asyncio.create_task(collector.get())
        await asyncio.sleep(0)
        collector.put(output("a", [1]))
        assert (await waiter).outputs[0].text == "a"
        collector.put(EngineDeadError("gone"))
        collector.put(output("b", [2]))
        with pytest.raises(EngineDeadError):
            await collector.get()

    asyncio.run(main())
