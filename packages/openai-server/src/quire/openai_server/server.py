"""Running the app: uvicorn, SIGTERM drain, and leaving when the engine dies."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable

import uvicorn

from quire.core.engine.core_proc import freeze_gc_heap
from quire.core.engine.protocol import EngineClient
from quire.core.engine_args import EngineArgs
from quire.openai_server.app import attach_engine, build_app
from quire.openai_server.settings import ServerSettings

logger = logging.getLogger(__name__)
WATCHDOG_SECONDS = 0.5
GRACEFUL_SHUTDOWN_SECONDS = 5


class QuireServer(uvicorn.Server):
    """uvicorn's server with Quire's start-up and shutdown rules.

    The port opens before the model has loaded; until then every route but ``/live`` answers 503 (see
    ``ServerMiddleware``). SIGTERM drains: new requests get 503 (``/health`` too), in-flight ones may finish for
    ``shutdown_timeout`` seconds, the rest are aborted, then the server exits 0. If the engine dies, the
    server exits with status 1 (in-flight requests have already failed with 500s).
    """

    def __init__(self, config: uvicorn.Config, state):
        super().__init__(config)
        self.state = state
        self.exit_code = 0
        self._drain_requested = False

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started and not self.should_exit and self.state.engine is not None:
            self.announce()

    def announce(self) -> None:
        settings = self.state.settings
        host = "localhost" if settings.host in ("0.0.0.0", "::") else settings.host
        print(f"Quire is serving {settings.served_model_names[0]} at http://{host}:{self.config.port}/v1", flush=True)

    def handle_exit(self, sig: int, frame) -> None:
        if sig == signal.SIGTERM and not self._drain_requested and not self.should_exit:
            self._drain_requested = True
            asyncio.get_event_loop().call_soon_threadsafe(self._start_drain)
            return
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True  # NOTE: not recorded as captured, so uvicorn does not re-raise it

    def _start_drain(self) -> None:
        asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        state, engine = self.state, self.state.engine
        state.draining = True
        if engine is None:  # still loading: nothing to drain
            self.should_exit = True
            return
        logger.info("draining: in-flight requests have %.0f s to finish", state.settings.shutdown_timeout)
        deadline = time.monotonic() + state.settings.shutdown_timeout
        while state.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        leftover = engine.unfinished_request_ids
        if leftover:
            logger.info("aborting %d requests still in flight", len(leftover))
            await engine.abort(leftover)
        deadline = time.monotonic() + 2  # let aborted streams send their last events
        while state.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.should_exit = True

    async def watch_engine(self) -> None:
        while not self.should_exit:
            if self.state.engine is not None and self.state.engine.errored:
                logger.error("the engine has died; the server is exiting")
                self.exit_code = 1
                self.should_exit = True
                return
            await asyncio.sleep(WATCHDOG_SECONDS)


async def serve(engine: EngineClient | None, settings: ServerSettings,
                load: Callable[[], EngineClient] | None = None) -> int:
    """Serve until SIGTERM/SIGINT or engine death; return the process exit status.

    With ``load`` (a blocking callable that returns the engine) and no ``engine``, the port opens first
    and answers 503 until ``load`` returns; if it raises, the server stops and the error propagates."""
    app = build_app(engine, settings)
    state = app.state.server
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS, access_log=False)
    server = QuireServer(config, state)
    if engine is not None:
        freeze_gc_heap()
    serving = asyncio.ensure_future(server.serve())
    watchdog = asyncio.ensure_future(server.watch_engine())
    try:
        if engine is None:
            try:
                engine = await asyncio.to_thread(load)
                attach_engine(state, engine)  # raises for a --lora-modules adapter the engine cannot apply
            except BaseException:
                server.should_exit = True
                raise
            freeze_gc_heap()
            if server.started and not server.should_exit:
                server.announce()
        await serving
    finally:
        watchdog.cancel()
        if not serving.done():
            await serving
    if engine.errored:
        server.exit_code = 1
    return server.exit_code


def run_server(engine_args: EngineArgs, settings: ServerSettings) -> int:
    """Open the port, start the engine (its own process) while answering 503, serve, and shut everything
    down; return the exit status."""
    from quire.core.engine.async_llm import AsyncLLM

    engines = []

    def load():
        engines.append(AsyncLLM.from_engine_args(engine_args))
        return engines[-1]

    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            return runner.run(serve(None, settings, load))
    finally:
        for engine in engines:
            engine.shutdown()


def event_loop_factory():
    """uvloop's event loop where it is installed (it comes with ``uvicorn[standard]``): each streamed
    token costs the front end less CPU than with asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
