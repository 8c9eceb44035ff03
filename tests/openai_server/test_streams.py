"""merge_streams, the streamed chunks and their response, and the server's event loop, without a server."""

import asyncio
import json

import msgspec
import pytest

from quire.openai_server.server import event_loop_factory
from quire.openai_server.serving import OUTER_SEND, ChunkWriter, EventStream, merge_streams


def tracked_stream(name: str, items: list, closed: list):
    async def stream():
        try:
            for item in items:
                await asyncio.sleep(0)
                yield f"{name}{item}"
        finally:
            closed.append(name)  # an engine stream aborts its request here

    return stream()


@pytest.mark.parametrize("count", [1, 3])
def test_merge_streams_yields_every_output_with_its_index(count):
    async def run():
        closed = []
        streams = [tracked_stream(str(i), [0, 1, 2], closed) for i in range(count)]
        return [pair async for pair in merge_streams(streams)], closed

    pairs, closed = asyncio.run(run())
    for i in range(count):
        assert [out for index, out in pairs if index == i] == [f"{i}0", f"{i}1", f"{i}2"]
    assert sorted(closed) == [str(i) for i in range(count)]


@pytest.mark.parametrize("count", [1, 3])
def test_closing_the_merged_stream_closes_every_stream_at_once(count):
    async def run():
        closed = []
        merged = merge_streams([tracked_stream(str(i), range(100), closed) for i in range(count)])
        await merged.__anext__()
        await merged.aclose()  # what a client disconnect does to the response generator
        return list(closed)  # now, not after asyncio.run's final clean-up of unfinished generators

    assert sorted(asyncio.run(run())) == [str(i) for i in range(count)]


def test_the_server_runs_on_uvloop_when_it_is_installed():
    uvloop = pytest.importorskip("uvloop")
    factory = event_loop_factory()
    assert factory is uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        assert runner.run(asyncio.sleep(0, result=7)) == 7


def _event(data: bytes) -> dict:
    assert data.startswith(b"data: ") and data.endswith(b"\n\n")
    return json.loads(data[len(b"data: "):-2])


@pytest.mark.parametrize("kind", ["text_completion", "chat.completion.chunk"])
def test_chunk_writer_writes_what_the_chunk_dict_encodes_to(kind):
    writer = ChunkWriter('cmpl-"1"', kind, 1700000000, "some/model é")
    head = {"id": 'cmpl-"1"', "object": kind, "created": 1700000000, "model": "some/model é"}
    for index, text in [(0, " hello"), (3, 'quote " and é \n'), (0, "")]:
        choice = ({"index": index, "text": text, "logprobs": None, "finish_reason": None, "stop_reason": None}
                  if kind == "text_completion" else
                  {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None})
        expected = b"data: " + msgspec.json.encode({**head, "choices": [choice]}) + b"\n\n"
        assert writer.text(index, text) == expected
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    choice = {"index": 1, "finish_reason": "length"}
    assert _event(writer.chunk([choice], usage)) == {**head, "choices": [choice], "usage": usage}
    assert _event(writer.chunk([])) == {**head, "choices": []}
    exact = writer.chunk([{"index": 0, "logprobs": {"token_logprobs": [float("-inf")]}}], exact_floats=True)
    assert b"-Infinity" in exact
    assert json.loads(exact[len(b"data: "):])["choices"][0]["logprobs"]["token_logprobs"] == [float("-inf")]


def _run_event_stream(events, client_leaves: bool):
    async def run():
        sent, outer_sent, closed = [], [], []
        disconnect = asyncio.Event()

        async def receive():
            await disconnect.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        async def outer_send(message):
            outer_sent.append(message)
            if client_leaves and len(outer_sent) == 2:
                disconnect.set()

        async def body():
            try:
                for event in events:
                    await asyncio.sleep(0.01)
                    yield event
            finally:
                closed.append(True)  # an engine stream aborts its request here

        await EventStream(body())({"type": "http", OUTER_SEND: outer_send}, receive, send)
        return sent, outer_sent, closed, asyncio.current_task().cancelling()

    return asyncio.run(run())


def test_event_stream_starts_through_the_middlewares_and_streams_to_the_outer_send():
    sent, outer_sent, closed, cancelling = _run_event_stream([b"a", b"b", b"c"], client_leaves=False)
    assert [m["type"] for m in sent] == ["http.response.start"]
    assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    assert [m["body"] for m in outer_sent] == [b"a", b"b", b"c", b""]
    assert [m["more_body"] for m in outer_sent] == [True, True, True, False]
    assert closed == [True] and cancelling == 0


def test_a_client_that_leaves_stops_the_event_stream_and_closes_its_generator():
    sent, outer_sent, closed, cancelling = _run_event_stream([b"x"] * 100, client_leaves=True)
    assert len(outer_sent) < 10 and all(m["more_body"] for m in outer_sent)
    assert closed == [True] and cancelling == 0  # the disconnect's cancellation does not leak out


def _direct_event_stream(gate_first_direct_write: bool = False, fail_on: str | None = None,
                         text_lane: list | None = None):
    """An ``EventStream`` over a real ``RequestStream``: returns the collector to put outputs into, the bodies
    written so far, the response's task and the gate that holds the first direct write (back-pressure).
    ``text_lane``: a list that receives the text sink's offer function (what the output processor calls with a
    plain step's text and token ids); its encoder declines text "slow"."""
    from quire.core.engine.output_collector import RequestOutputCollector, RequestStream
    from quire.core.outputs import CompletionOutput, RequestOutput
    from quire.core.sampling_params import RequestOutputKind

    class Processor:
        def set_text_sink(self, request_id, offer):
            text_lane.append(offer)
            return True

    class Engine:
        collectors: dict = {}
        output_processor = Processor()

        def _abort_now(self, request_ids):
            pass

    collector = RequestOutputCollector(RequestOutputKind.DELTA)
    stream = RequestStream(Engine(), "r", collector, [1], None)
    written: list[bytes] = []
    gate = asyncio.get_running_loop().create_future()

    def events_of(out: RequestOutput) -> bytes:
        if out.outputs[0].text == fail_on:
            raise ValueError("cannot encode this one")
        return out.outputs[0].text.encode()

    async def events():
        try:
            async for out in stream:
                yield events_of(out)
        except ValueError:
            yield b"error"
        yield b"end"

    direct_writes = []

    async def outer_send(message):
        if message["body"] and gate_first_direct_write and not direct_writes and not gate.done():
            direct_writes.append(message["body"])
            await gate  # the server waits for the client to read
        written.append(message["body"])

    async def receive():
        await asyncio.Event().wait()

    async def send(message):
        pass

    def text_of(text: str, token_ids: list[int]) -> bytes | None:
        return None if text == "slow" else text.encode()

    response = EventStream(events(), (stream, events_of) if text_lane is None else (stream, events_of, text_of))
    task = asyncio.ensure_future(response({"type": "http", OUTER_SEND: outer_send}, receive, send))

    def put(text: str, finished: bool = False):
        collector.put(RequestOutput("r", None, [1], [CompletionOutput(0, text, [7], "length" if finished else None)],
                                    finished))

    return put, written, task, gate


async def _release_then_finish(gate, put, task, last: str) -> None:
    """Let the held write through, then end the stream with the final output ``last``."""
    gate.set_result(None)
    await asyncio.sleep(0.01)
    put(last, finished=True)
    await asyncio.wait_for(task, 5)


def test_tokens_are_written_from_the_output_handler_in_order_and_the_final_one_by_the_pump():
    async def run():
        put, written, task, _ = _direct_event_stream()
        await asyncio.sleep(0.01)  # the pump waits on the stream
        put("a")
        assert written == [b"a"]  # written at once, no task woken
        put("b")
        put("c", finished=True)
        await asyncio.wait_for(task, 5)
        return written

    assert asyncio.run(run()) == [b"a", b"b", b"c", b"end", b""]


def test_a_direct_write_held_by_back_pressure_keeps_later_events_behind_it():
    async def run():
        put, written, task, gate = _direct_event_stream(gate_first_direct_write=True)
        await asyncio.sleep(0.01)
        put("a")  # held: the client is not reading
        put("b")  # the sink declines while "a" waits: queued for the pump
        await asyncio.sleep(0.01)
        assert written == []  # the pump waits for "a" before it writes "b"
        await _release_then_finish(gate, put, task, "c")
        return written

    assert asyncio.run(run()) == [b"a", b"b", b"c", b"end", b""]


def test_an_output_the_direct_lane_cannot_encode_goes_to_the_pump_which_reports_it():
    async def run():
        put, written, task, _ = _direct_event_stream(fail_on="bad")
        await asyncio.sleep(0.01)
        put("a")
        put("bad")
        await asyncio.wait_for(task, 5)
        return written

    assert asyncio.run(run()) == [b"a", b"error", b"end", b""]


def test_plain_steps_go_through_the_text_sink_at_the_end_of_the_step_in_order_with_the_outputs():
    async def run():
        lane = []
        put, written, task, _ = _direct_event_stream(text_lane=lane)
        await asyncio.sleep(0.01)  # the pump waits on the stream
        offer = lane[0]
        assert offer("a", [7]) and written == []  # taken, no output object built, held for the step's end
        await asyncio.sleep(0)
        assert written == [b"a"]
        assert offer("b", [7]) and offer("c", [7])  # two steps before the loop came round: one write
        assert not offer("slow", [7])  # the encoder declines: the caller builds the output instead ...
        put("slow")  # ... and its direct write comes after what the lane held
        assert written == [b"a", b"bc", b"slow"]
        assert offer("d", [7])
        put("e", finished=True)  # the pump writes the final output after what the lane held
        await asyncio.wait_for(task, 5)
        assert lane[-1] is None  # the response removed its text sink at the end
        return written

    assert asyncio.run(run()) == [b"a", b"bc", b"slow", b"d", b"e", b"end", b""]


def test_a_text_sink_write_held_by_back_pressure_keeps_later_steps_behind_it():
    async def run():
        lane = []
        put, written, task, gate = _direct_event_stream(gate_first_direct_write=True, text_lane=lane)
        await asyncio.sleep(0.01)
        offer = lane[0]
        assert offer("a", [7])
        await asyncio.sleep(0)  # written at the step's end, and held: the client is not reading
        assert not offer("b", [7])  # declined while "a" waits ...
        put("b")  # ... so it is built and queued for the pump
        assert not offer("c", [7])  # and nothing overtakes it
        put("c")
        await asyncio.sleep(0.01)
        assert written == []
        await _release_then_finish(gate, put, task, "d")
        return written

    assert asyncio.run(run()) == [b"a", b"bc", b"d", b"end", b""]


class _Transport:
    def __init__(self):
        self.data = b""

    def write(self, data):
        self.data += data


class _Flow:
    write_paused = False


class _Cycle:
    """The parts of uvicorn's httptools ``RequestResponseCycle`` that ``raw_chunk_writer`` relies on."""

    def __init__(self, method="POST", chunked=True):
        self.transport, self.flow, self.scope = _Transport(), _Flow(), {"method": method}
        self.disconnected, self.response_started, self.response_complete = False, True, False
        self.chunked_encoding = chunked

    async def send(self, message):
        raise AssertionError("not used here")


_Cycle.__module__ = "uvicorn.protocols.http.httptools_impl"


def test_the_raw_chunk_writer_frames_chunks_as_uvicorn_and_steps_aside_when_it_must():
    from quire.openai_server.serving import raw_chunk_writer

    cycle = _Cycle()
    write = raw_chunk_writer(cycle.send).write
    assert write(b"data: x\n\n") and cycle.transport.data == b"9\r\ndata: x\n\n\r\n"
    cycle.flow.write_paused = True  # the client reads slowly: ``send`` waits, the writer does not write
    assert not write(b"y") and cycle.transport.data == b"9\r\ndata: x\n\n\r\n"
    cycle.flow.write_paused, cycle.disconnected = False, True
    assert not write(b"y")
    cycle.disconnected, cycle.response_complete = False, True
    assert not write(b"y")
    assert raw_chunk_writer(_Cycle(method="HEAD").send) is None
    assert raw_chunk_writer(_Cycle(chunked=False).send) is None

    async def send(message):
        pass

    assert raw_chunk_writer(send) is None  # another server's send: the ASGI way


def test_the_raw_chunk_writer_under_the_real_uvicorn_gives_the_chunks_the_client_reads():
    import httpx
    import uvicorn

    from quire.openai_server.serving import raw_chunk_writer
    from tests.servers import free_port

    found = []

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        writer = raw_chunk_writer(send)
        found.append(writer is not None)
        for part in (b"one ", b"two ", b"three"):
            assert writer.write(part)
            await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def main():
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                               http="httptools", lifespan="off"))
        serving = asyncio.ensure_future(server.serve())
        try:
            async with httpx.AsyncClient(timeout=10) as client:
                for _ in range(100):
                    if server.started:
                        break
                    await asyncio.sleep(0.05)
                response = await client.get(f"http://127.0.0.1:{port}/")
                return response.status_code, response.text, response.headers.get("transfer-encoding")
        finally:
            server.should_exit = True
            await asyncio.wait_for(serving, 10)

    assert asyncio.run(main()) == (200, "one two three", "chunked")
    assert found == [True]
