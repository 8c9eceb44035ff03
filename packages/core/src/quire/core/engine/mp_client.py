"""Engine-core clients that talk to an ``EngineCoreProc`` over ZMQ: synchronous and asyncio.

The front end binds two IPC sockets in a private temporary folder (PUSH for requests, PULL for outputs),
spawns the engine process, and waits for its ``EngineReady`` message, failing fast with the engine's own
error message if it cannot start. A monitor thread watches the process: if it dies (or sends the dead
sentinel), every waiting caller gets ``EngineDeadError`` and new calls fail at once.

A data-parallel client (``dp_client``) holds several of these: it passes each the one output queue they
all fill, and an ``on_dead`` callback that hears of any engine's death.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future

import msgspec
import zmq
import zmq.asyncio

from quire.core.config import EngineConfig
from quire.core.engine.core_client import AsyncOnlyClient, EngineCoreClient
from quire.core.errors import ConfigError, EngineDeadError, EngineUtilityError
from quire.core.wire import (
    ENGINE_DEAD_SENTINEL,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    EngineStartupFailure,
    RequestType,
    UtilityCall,
)

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_SECONDS = float(os.environ.get("QUIRE_ENGINE_STARTUP_TIMEOUT", "600"))
# NOTE: libgomp's idle OpenMP workers spin 300,000 times before they sleep; while they spin they hold
# the cores that the front end (another process) needs between steps. A tenth of that keeps the engine
# as fast (measured: equal on the small checkpoint, faster on the tiny one) and cut the process
# boundary's cost on 2 cores from 6-7% to 1-2%.
ENGINE_SPIN_COUNT = "30000"
# NOTE: hugetlb=1: glibc (2.35 on) then asks the kernel for transparent huge pages (madvise) for the large
# blocks malloc maps: the weights and the KV cache, which a decode step streams. On 4 KB pages each step takes a
# TLB miss every 4 KB of them; SmolLM2-135M in bfloat16 on two Intel AMX cores went from 12.4-12.9 to 10.4-11.2 ms
# a batch-1 token and from 48.6-50.1 to 45.4-46.9 ms a batch-64 step.
# mmap_threshold and trim_threshold: a prompt step's intermediates (up to 16 MiB each) then come from the heap
# and go back to it, instead of maps (or a heap top) that glibc's own thresholds, which move as blocks are freed,
# hand back to the kernel and fault in afresh, each fault a huge page to find and zero: on the same machine a
# prefill of 64 prompts of 128 tokens (four a process, in-process engine) took 146-1,141 ms of system time in a
# process's first and up to 249 ms in a later one, against 7-19 and 0-15 ms with these. Blocks over 32 MiB
# (glibc's largest threshold: the KV cache, an embedding) are still maps of their own.
# Other C libraries ignore the variable, and so does a kernel with transparent huge pages off.
ENGINE_MALLOC_TUNABLES = {"glibc.malloc.hugetlb": "1", "glibc.malloc.mmap_threshold": str(32 << 20),
                          "glibc.malloc.trim_threshold": str(1 << 40)}


def engine_environment() -> dict[str, str]:
    """The engine process's environment: the caller's, with a shorter OpenMP spin unless one is set, and
    ``ENGINE_MALLOC_TUNABLES`` added to ``GLIBC_TUNABLES`` except where the caller set that tunable itself."""
    env = dict(os.environ)
    if "GOMP_SPINCOUNT" not in env and "OMP_WAIT_POLICY" not in env:
        env["GOMP_SPINCOUNT"] = ENGINE_SPIN_COUNT
    tunables = [entry for entry in env.get("GLIBC_TUNABLES", "").split(":") if entry]
    chosen = {entry.split("=", 1)[0] for entry in tunables}
    tunables += [f"{name}={value}" for name, value in ENGINE_MALLOC_TUNABLES.items() if name not in chosen]
    env["GLIBC_TUNABLES"] = ":".join(tunables)
    return env


_POLL_MS = 100


# Engine cores on other machines: ZMQ heartbeats notice a peer that went silent (a machine lost) as a
# disconnection, as a closed connection (a process killed) is noticed at once.
HEARTBEAT_INTERVAL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000


def set_heartbeats(socket: zmq.Socket) -> None:
    socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_INTERVAL_MS)
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    socket.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)


class _Resources:
    """What must be released however the client goes away (explicit shutdown or garbage collection).

    The sockets are IPC sockets in a private temporary folder, or TCP sockets on ``host`` (free ports) for
    an engine core on another machine or in a Ray actor."""

    def __init__(self, host: str | None = None):
        self.socket_dir = tempfile.mkdtemp(prefix="quire-engine-") if host is None else None
        self.context = zmq.Context()
        self.input_socket = self.context.socket(zmq.PUSH)
        self.output_socket = self.context.socket(zmq.PULL)
        for socket in (self.input_socket, self.output_socket):
            socket.setsockopt(zmq.LINGER, 0)
            if host is not None:
                set_heartbeats(socket)
        if host is None:
            self.input_address = f"ipc://{self.socket_dir}/input"
            self.output_address = f"ipc://{self.socket_dir}/output"
            self.input_socket.bind(self.input_address)
            self.output_socket.bind(self.output_address)
        else:
            tcp_host = f"[{host}]" if ":" in host else host
            self.input_address = f"tcp://{tcp_host}:{self.input_socket.bind_to_random_port(f'tcp://{tcp_host}')}"
            self.output_address = f"tcp://{tcp_host}:{self.output_socket.bind_to_random_port(f'tcp://{tcp_host}')}"
        self.process = None  # the engine core: a subprocess.Popen, or a handle with its methods (remote_engines)
        self.shutting_down = threading.Event()
        self.extra_sockets: list = []

    def stop_engine(self) -> None:
        """Ask the engine core to stop: SIGTERM for a child process; for one elsewhere, which no signal
        reaches, a SHUTDOWN message first."""
        self.shutting_down.set()  # its exit is expected: not a death to report
        process = self.process
        if process is None or process.poll() is not None:
            return
        if not isinstance(process, subprocess.Popen):
            try:
                self.input_socket.send_multipart([RequestType.SHUTDOWN.value, b""], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # nothing connected: the handle's terminate and kill do the rest
        process.terminate()

    def close(self) -> None:
        process = self.process
        self.stop_engine()
        if process is not None and process.poll() is None:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
        for socket in [*self.extra_sockets, self.input_socket, self.output_socket]:
            socket.close(linger=0)
        self.context.term()
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)


class LocalEngineLauncher:
    """Starts the engine core as a child process of this one, on IPC sockets (the default)."""

    host: str | None = None

    def launch(self, resources: _Resources, config: EngineConfig) -> subprocess.Popen:
        # A fresh interpreter (not multiprocessing's spawn, which re-runs the caller's main script).
        process = subprocess.Popen(
            [sys.executable, "-m", "quire.core.engine.core_proc", resources.input_address,
             resources.output_address, str(os.getpid()), resources.socket_dir],
            stdin=subprocess.PIPE, env=engine_environment(),
        )
        process.stdin.write(msgspec.msgpack.encode(config))
        process.stdin.close()
        return process


class MPClient(EngineCoreClient):
    """Starts the engine core process and owns the sockets to it."""

    def __init__(self, config: EngineConfig, on_dead: Callable[[MPClient], None] | None = None,
                 launcher=None):
        """``launcher`` starts the engine core (``LocalEngineLauncher`` by default; ``remote_engines`` has
        the launchers of engine cores on other machines and in Ray actors)."""
        launcher = LocalEngineLauncher() if launcher is None else launcher
        self._on_dead = on_dead
        self._resources = resources = _Resources(launcher.host)
        self._finalizer = weakref.finalize(self, resources.close)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._call_ids = itertools.count(1)
        self.engine_dead = False
        try:
            resources.process = launcher.launch(resources, config)
            ready = self._wait_for_ready()
        except BaseException:
            self.shutdown()
            raise
        self.max_model_len = ready.max_model_len
        self.num_blocks = ready.num_blocks
        self.block_size = ready.block_size
        threading.Thread(target=self._monitor, name="engine-monitor", daemon=True).start()

    @property
    def process(self) -> subprocess.Popen:
        """The engine core's process (or, for one elsewhere, a handle with the same methods)."""
        return self._resources.process

    def _wait_for_ready(self) -> EngineReady:
        socket, process = self._resources.output_socket, self._resources.process
        deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            if socket.poll(_POLL_MS):
                message = msgspec.msgpack.decode(socket.recv(), type=EngineReady | EngineStartupFailure)
                if isinstance(message, EngineStartupFailure):
                    raise ConfigError(f"the engine core failed to start: {message.error_type}: "
                                      f"{message.message}")
                return message
            if process.poll() is not None:
                raise ConfigError(f"the engine core {getattr(process, 'description', 'process')} exited during "
                                  f"start-up (exit code {process.returncode}); see its log")
        raise ConfigError(f"the engine core did not start within {STARTUP_TIMEOUT_SECONDS:.0f} s "
                          "(QUIRE_ENGINE_STARTUP_TIMEOUT)")

    def _monitor(self) -> None:
        process = self._resources.process
        process.wait()
        if not self._resources.shutting_down.is_set():
            logger.error("the engine core %s died (exit code %s)", getattr(process, "description", "process"),
                         process.returncode)
            self._mark_dead()

    def _mark_dead(self) -> None:
        """Record the death and wake every waiting caller (each client variant knows how)."""
        self.engine_dead = True
        if self._on_dead is not None:
            self._on_dead(self)

    def fail_and_stop(self) -> None:
        """Fail every waiting caller with ``EngineDeadError`` and stop the engine process without waiting
        for it (another engine core of the same data-parallel group died). ``shutdown`` still follows."""
        if self.engine_dead:
            return
        self._resources.shutting_down.set()  # its exit is expected: not a death to report
        self._mark_dead()
        self._resources.stop_engine()

    def stop_engine(self) -> None:
        """Ask the engine core to stop without waiting for it (``shutdown`` still follows)."""
        self._resources.stop_engine()

    def ensure_alive(self) -> None:
        if self.engine_dead:
            raise EngineDeadError("the engine core is dead; no more requests can be served")

    def _message(self, request_type: RequestType, payload) -> list[bytes]:
        return [request_type.value, self._encoder.encode(payload)]

    def _decode_output(self, frame: bytes) -> EngineCoreOutputs | None:
        """Decode one output message; None (after marking the engine dead) for the dead sentinel."""
        if bytes(frame) == ENGINE_DEAD_SENTINEL:
            logger.error("the engine core reported a fatal error")
            self._mark_dead()
            return None
        return self._decoder.decode(frame)

    def _utility_call(self, method: str, args) -> UtilityCall:
        return UtilityCall(next(self._call_ids), method, list(args))

    def _resolve(self, utility_output) -> None:
        """Complete the waiting utility call (a ``concurrent.futures`` or ``asyncio`` future)."""
        future = self._pending_calls.pop(utility_output.call_id, None)
        if future is None or future.done():
            return
        if utility_output.failure_message is not None:
            future.set_exception(EngineUtilityError(utility_output.failure_message))
        else:
            future.set_result(utility_output.result)

    def shutdown(self) -> None:
        self._finalizer()


class SyncMPClient(MPClient):
    """Blocking client for ``LLMEngine``: an output thread fills a queue that ``get_output`` reads."""

    def __init__(self, config: EngineConfig, outputs: queue.Queue | None = None,
                 on_dead: Callable[[MPClient], None] | None = None, launcher=None):
        self._outputs: queue.Queue = queue.Queue() if outputs is None else outputs
        self._pending_calls: dict[int, Future] = {}
        self._send_lock = threading.Lock()
        super().__init__(config, on_dead, launcher)
        threading.Thread(target=self._output_loop, name="engine-output-reader", daemon=True).start()

    def _output_loop(self) -> None:
        socket, stopping = self._resources.output_socket, self._resources.shutting_down
        try:
            while not stopping.is_set() and not self.engine_dead:
                if not socket.poll(_POLL_MS):
                    continue
                outputs = self._decode_output(socket.recv(copy=False).buffer)
                if outputs is None:
                    return
                if outputs.utility_output is not None:
                    self._resolve(outputs.utility_output)
                else:
                    self._outputs.put(outputs)
        except zmq.ZMQError:
            if not stopping.is_set():
                raise

    def _mark_dead(self) -> None:
        super()._mark_dead()
        self._outputs.put(EngineDeadError("the engine core died; see its log for the cause"))
        for future in list(self._pending_calls.values()):
            future.set_exception(EngineDeadError("the engine core died during a utility call"))
        self._pending_calls.clear()

    def _send(self, request_type: RequestType, payload) -> None:
        self.ensure_alive()
        with self._send_lock:
            self._resources.input_socket.send_multipart(self._message(request_type, payload), copy=False)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(RequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.engine_dead:
            self._send(RequestType.ABORT, list(request_ids))

    def get_output(self) -> EngineCoreOutputs:
        item = self._outputs.get()
        if isinstance(item, BaseException):
            self._outputs.put(item)  # every later caller fails the same way
            raise item
        return item

    def call_utility(self, method: str, *args, timeout: float = 60.0):
        call = self._utility_call(method, args)
        future: Future = Future()
        self._pending_calls[call.call_id] = future
        self._send(RequestType.UTILITY, call)
        try:
            return future.result(timeout=timeout)
        except TimeoutError:
            self._pending_calls.pop(call.call_id, None)
            raise EngineUtilityError(f"{method} got no answer from the engine core in {timeout:.0f} s") from None



class AsyncMPClient(MPClient, AsyncOnlyClient):
    """asyncio client for ``AsyncLLM``: a reader task fills an ``asyncio.Queue``."""

    def __init__(self, config: EngineConfig, outputs: asyncio.Queue | None = None,
                 on_dead: Callable[[MPClient], None] | None = None, launcher=None):
        # NOTE: set before the base class starts the engine, whose start-up failure calls shutdown()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outputs: asyncio.Queue | None = outputs  # None: made when the reader starts
        self._reader: asyncio.Task | None = None
        self._pending_calls: dict[int, asyncio.Future] = {}
        super().__init__(config, on_dead, launcher)
        resources = self._resources
        self._input = zmq.asyncio.Socket.shadow(resources.input_socket.underlying)
        self._output = zmq.asyncio.Socket.shadow(resources.output_socket.underlying)

    def start(self) -> None:
        """Start reading outputs on the running event loop (every call does this first; idempotent)."""
        if self._reader is None:
            self._loop = asyncio.get_running_loop()
            if self._outputs is None:
                self._outputs = asyncio.Queue()
            self._reader = self._loop.create_task(self._read_outputs(), name="engine-output-reader")
            if self.engine_dead:
                self._mark_dead()

    async def _read_outputs(self) -> None:
        try:
            while True:
                frame = await self._output.recv(copy=False)
                outputs = self._decode_output(frame.buffer)
                if outputs is None:
                    return
                if outputs.utility_output is not None:
                    self._resolve(outputs.utility_output)
                else:
                    self._outputs.put_nowait(outputs)
        except (asyncio.CancelledError, zmq.ZMQError):
            return

    def _mark_dead(self) -> None:
        super()._mark_dead()
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        if _in_loop(loop):
            self._fail_waiters()
        else:
            loop.call_soon_threadsafe(self._fail_waiters)

    def _fail_waiters(self) -> None:
        error = EngineDeadError("the engine core died; see its log for the cause")
        if self._outputs is not None:
            self._outputs.put_nowait(error)
        for future in self._pending_calls.values():
            if not future.done():
                future.set_exception(EngineDeadError("the engine core died during a utility call"))
        self._pending_calls.clear()

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self.start()
        self.ensure_alive()
        await self._input.send_multipart(self._message(RequestType.ADD, request), copy=False)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self.start()
        if request_ids and not self.engine_dead and not self._resources.shutting_down.is_set():
            await self._input.send_multipart(self._message(RequestType.ABORT, list(request_ids)))

    async def get_output_async(self) -> EngineCoreOutputs:
        self.start()
        item = await self._outputs.get()
        if isinstance(item, BaseException):
            self._outputs.put_nowait(item)
            raise item
        return item

    async def call_utility_async(self, method: str, *args, timeout: float = 60.0):
        self.start()
        self.ensure_alive()
        call = self._utility_call(method, args)
        future = self._loop.create_future()
        self._pending_calls[call.call_id] = future
        await self._input.send_multipart(self._message(RequestType.UTILITY, call))
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            self._pending_calls.pop(call.call_id, None)
            raise EngineUtilityError(f"{method} got no answer from the engine core in {timeout:.0f} s") from None

    def shutdown(self) -> None:
        reader = self._reader
        if reader is not None and not reader.done() and not self._loop.is_closed():
            reader.cancel()
        super().shutdown()  # closes the sockets the shadows share


def _in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
