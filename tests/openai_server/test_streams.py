"""merge_streams and the server's event loop, without a server."""

import asyncio

import pytest

from quire.openai_server.server import event_loop_factory
from quire.openai_server.serving import merge_streams


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
