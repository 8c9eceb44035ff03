"""The server app on an in-process AsyncLLM whose engine core records every request it receives, for tests
that show a refused request never reaches the engine."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from fastapi.testclient import TestClient

from quire.core.engine.async_llm import AsyncLLM
from quire.core.engine_args import EngineArgs
from quire.openai_server.app import build_app
from quire.openai_server.settings import ServerSettings


@contextlib.contextmanager
def counting_app(engine_args: EngineArgs, settings: ServerSettings) -> Iterator[tuple[TestClient, list]]:
    """A test client of the app, and the list of ``EngineCoreRequest``s the engine core has received."""
    engine = AsyncLLM(engine_args.create_engine_config())
    calls = []
    add_request = engine.engine_core.add_request_async

    async def counting_add_request(request):
        calls.append(request)
        return await add_request(request)

    engine.engine_core.add_request_async = counting_add_request
    try:
        with TestClient(build_app(engine, settings), raise_server_exceptions=False) as client:
            yield client, calls
    finally:
        engine.shutdown()
