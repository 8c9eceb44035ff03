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


class _Engine:
    """What a ``RequestStream`` needs of its engine."""

    def __init__(self):
        self.collectors, self.aborted = {}, []

    def _abort_now(self, request_ids):
        self.aborted += request_ids


def test_a_sink_takes_outputs_only_while_the_reader_waits_and_never_the_final_one():
    from quire.core.engine.output_collector import RequestStream

    async def main():
        collector = RequestOutputCollector(RequestOutputKind.DELTA)
        stream = RequestStream(_Engine(), "r", collector, [1], None)
        taken = []

        def sink(item):
            taken.append(item.outputs[0].text)
            return item.outputs[0].text != "declined"

        stream.set_sink(sink)
        collector.put(output("early", [1]))  # nobody waits yet: queued for the reader
        assert taken == [] and (await anext(stream)).outputs[0].text == "early"
        reader = asyncio.create_task(anext(stream))
        await asyncio.sleep(0)  # the reader now waits
        collector.put(output("a", [2]))
        collector.put(output("b", [3]))
        assert taken == ["a", "b"] and not reader.done()
        collector.put(output("declined", [4]))  # the sink says no: the reader gets it
        collector.put(output("c", [5]))  # queued behind it (merged), not offered
        assert taken == ["a", "b", "declined"]
        assert (await reader).outputs[0].text == "declinedc"
        reader = asyncio.create_task(anext(stream))
        await asyncio.sleep(0)
        collector.put(output("end", [6], finished=True))  # the final output always goes to the reader
        assert taken == ["a", "b", "declined"] and (await reader).finished
        stream.set_sink(None)
        assert collector.sink is None

    asyncio.run(main())


def test_a_text_sink_is_offered_steps_only_while_the_reader_waits_with_nothing_queued():
    from quire.core.engine.output_collector import RequestStream

    class Processor:
        def set_text_sink(self, request_id, sink):
            self.request_id, self.offer = request_id, sink
            return True

    async def main():
        engine = _Engine()
        engine.output_processor = Processor()
        collector = RequestOutputCollector(RequestOutputKind.DELTA)
        stream = RequestStream(engine, "r", collector, [1], None)
        taken = []

        def sink(text, token_ids):
            taken.append(text)
            return text != "declined"

        assert stream.set_text_sink(sink)
        offer = engine.output_processor.offer
        assert engine.output_processor.request_id == "r" and offer is not None
        assert not offer("early", [1]) and taken == []  # nobody waits yet
        reader = asyncio.create_task(anext(stream))
        await asyncio.sleep(0)
        assert offer("a", [2]) and offer("b", [3]) and taken == ["a", "b"]
        assert not offer("declined", [4]) and taken == ["a", "b", "declined"]
        collector.put(output("queued", [5]))  # the reader's: later steps must not overtake it
        assert not offer("c", [6]) and taken == ["a", "b", "declined"]
        assert (await reader).outputs[0].text == "queued"
        assert stream.set_text_sink(None)
        assert engine.output_processor.offer is None and collector.text_sink is None

    asyncio.run(main())


def test_a_cancelled_wait_is_no_longer_offered_text_and_a_later_wait_is():
    async def main():
        collector = RequestOutputCollector(RequestOutputKind.DELTA)
        taken = []
        collector.text_sink = lambda text, token_ids: taken.append(text) or True
        waiting = asyncio.create_task(collector.get())
        await asyncio.sleep(0)
        assert collector.offer_text("a", [1]) and taken == ["a"]
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert not collector.offer_text("b", [2]) and taken == ["a"]  # nobody waits: the usual way
        collector.put(output("b", [2]))
        assert (await collector.get()).outputs[0].text == "b"
        again = asyncio.create_task(collector.get())
        await asyncio.sleep(0)
        assert collector.offer_text("c", [3]) and taken == ["a", "c"]
        collector.put(output("end", [4], finished=True))
        assert (await again).outputs[0].text == "end"

    asyncio.run(main())
