"""The engine core in its own process.

Three threads: the input thread receives and decodes messages into a queue; the main thread runs the busy
loop (queue → scheduler → step → queue), touching no socket; the output thread encodes and sends.
The first message out is ``EngineReady`` (or ``EngineStartupFailure``); a fatal error sends
``ENGINE_DEAD_SENTINEL`` before the process exits. The process also exits by itself when its parent
(the front end) dies.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import shutil
import signal
import sys
import threading
import time

import msgspec
import zmq

from quire.core.config import EngineConfig
from quire.core.engine.core_client import run_utility
from quire.core.errors import EngineUtilityError
from quire.core.request import FinishReason
from quire.core.wire import (
    ENGINE_DEAD_SENTINEL,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    EngineStartupFailure,
    RequestType,
    UtilityCall,
    UtilityOutput,
)

logger = logging.getLogger(__name__)

_SHUTDOWN = object()  # wakes the busy loop to stop
_PARENT_POLL_SECONDS = 0.5
_WATCH_POLL_MS = 100


def main() -> None:
    """``python -m quire.core.engine.core_proc INPUT OUTPUT PARENT_PID [SOCKET_DIR]`` with the
    msgpack-encoded ``EngineConfig`` on stdin (how ``MPClient`` and headless launchers start engine cores)."""
    input_address, output_address, parent_pid = sys.argv[1:4]
    socket_dir = sys.argv[4] if len(sys.argv) > 4 else None
    config = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=EngineConfig)
    run_engine_core(config, input_address, output_address, int(parent_pid), socket_dir)


def run_engine_core(config: EngineConfig, input_address: str, output_address: str, parent_pid: int,
                    socket_dir: str | None = None) -> None:
    """Run the engine core process until it is told to stop, its parent dies, or it fails."""
    configure_logging()
    _watch_parent(parent_pid, socket_dir)
    exit_code = serve_engine_core(config, input_address, output_address, handle_signals=True)
    sys.stdout.flush()
    sys.stderr.flush()
    # NOTE: os._exit, not sys.exit: the input thread is blocked in recv and the zmq context must not
    # be waited for at interpreter shutdown.
    os._exit(exit_code)


def configure_logging() -> None:
    logging.basicConfig(level=os.environ.get("QUIRE_LOG_LEVEL", "INFO"), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [engine core] %(message)s")


def serve_engine_core(config: EngineConfig, input_address: str, output_address: str,
                      handle_signals: bool = False) -> int:
    """Build the engine core, report to the front end at the two addresses, and serve it until told to stop
    or until it fails; returns the exit code. Over TCP (an engine core on another machine or in a Ray actor)
    the process exits as soon as the front end disconnects."""
    context = zmq.Context()
    output_socket = context.socket(zmq.PUSH)
    output_socket.setsockopt(zmq.LINGER, 4000)  # so that the dead sentinel still leaves
    stop_watch = None
    if output_address.startswith("tcp://"):
        from quire.core.engine.mp_client import set_heartbeats

        set_heartbeats(output_socket)
        stop_watch = _watch_front_end(output_socket, output_address)
    output_socket.connect(output_address)
    encoder = msgspec.msgpack.Encoder()
    try:
        from quire.core.engine.core import EngineCore

        engine_core = EngineCore(config)
    except BaseException as error:  # noqa: BLE001 - every start-up failure is reported
        logger.exception("engine core failed to start")
        output_socket.send(encoder.encode(EngineStartupFailure(type(error).__name__, str(error))))
        if stop_watch is not None:
            stop_watch.set()
        output_socket.close()
        return 1
    freeze_gc_heap()
    output_socket.send(encoder.encode(EngineReady(config.model.max_model_len, engine_core.num_blocks,
                                                  config.cache.block_size)))
    process = EngineCoreProc(engine_core, context, input_address, output_socket)
    if handle_signals:
        signal.signal(signal.SIGTERM, lambda *_: process.request_shutdown())
        signal.signal(signal.SIGINT, lambda *_: process.request_shutdown())
    exit_code = process.run()
    if stop_watch is not None:
        stop_watch.set()
    output_socket.close(linger=2000)  # the output thread is done with it
    return exit_code


def _watch_front_end(socket: zmq.Socket, address: str) -> threading.Event:
    """Exit the process when the front end at ``address`` disconnects (it died, or went silent past the
    heartbeat timeout): an engine core elsewhere has no parent process to watch. Setting the returned event
    stops the watch (the engine core ended normally)."""
    monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            if monitor.poll(_WATCH_POLL_MS):
                logger.error("the front end at %s disconnected; the engine core exits", address)
                sys.stderr.flush()
                os._exit(1)
        monitor.close(linger=0)

    threading.Thread(target=watch, name="front-end-watchdog", daemon=True).start()
    return stop


def freeze_gc_heap() -> None:
    """Move everything alive after start-up (the model, the tokenizer, the imported libraries: hundreds of
    thousands of objects) out of the garbage collector's reach: a full collection would otherwise walk
    them all (~160 ms in the API process) every so often while requests are being served."""
    gc.collect()
    gc.freeze()


def _watch_parent(parent_pid: int, socket_dir: str | None) -> None:
    """Exit when the parent (the front end, or a headless launcher) is gone."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_SECONDS)
        logger.error("the front-end process is gone; the engine core exits")
        if socket_dir:
            shutil.rmtree(socket_dir, ignore_errors=True)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


class EngineCoreProc:
    """Runs an ``EngineCore`` between an input and an output thread."""

    def __init__(self, engine_core, context: zmq.Context, input_address: str, output_socket: zmq.Socket):
        self.engine_core = engine_core
        self.engine_index = engine_core.config.parallel.data_parallel_rank
        self.input_queue: queue.Queue = queue.Queue()
        self.output_queue: queue.Queue = queue.Queue()
        self._shutdown = threading.Event()
        self._input_thread = threading.Thread(target=self._input_loop, args=(context, input_address),
                                              name="engine-input", daemon=True)
        self._output_thread = threading.Thread(target=self._output_loop, args=(output_socket,),
                                               name="engine-output", daemon=True)
        self._input_thread.start()
        self._output_thread.start()

    def request_shutdown(self) -> None:
        self._shutdown.set()
        self.input_queue.put(_SHUTDOWN)

    def run(self) -> int:
        """The busy loop; returns the process exit code."""
        try:
            while not self._shutdown.is_set():
                had_requests = self.engine_core.has_unfinished_requests()
                self._process_input(block=not had_requests)
                # NOTE: when aborts leave the engine idle, the step still runs once (it returns at once
                # with no outputs) so that the front end's statistics see the freed requests and blocks.
                if (had_requests or self.engine_core.has_unfinished_requests()) and not self._shutdown.is_set():
                    self.output_queue.put(self.engine_core.step())
        except BaseException:  # noqa: BLE001 - any error kills the engine, and the front end must know
            logger.exception("engine core died")
            self.output_queue.put(ENGINE_DEAD_SENTINEL)
            self._output_thread.join(timeout=5)
            return 1
        self.output_queue.put(None)
        self._output_thread.join(timeout=5)
        return 0

    def _process_input(self, block: bool) -> None:
        try:
            item = self.input_queue.get(block=block)
        except queue.Empty:
            return
        while True:
            if item is _SHUTDOWN:
                return
            self._handle(*item)
            try:
                item = self.input_queue.get_nowait()
            except queue.Empty:
                return

    def _handle(self, request_type: RequestType, payload) -> None:
        if request_type == RequestType.ADD:
            try:
                self.engine_core.add_request(payload)
            except Exception as error:  # noqa: BLE001 - a bad request fails alone
                self.output_queue.put(EngineCoreOutputs(outputs=[EngineCoreOutput(
                    payload.request_id, [], FinishReason.ERROR, error_message=str(error))]))
        elif request_type == RequestType.ABORT:
            self.engine_core.abort_requests(payload)
        elif request_type == RequestType.UTILITY:
            self.output_queue.put(EngineCoreOutputs(utility_output=self._call_utility(payload)))

    def _call_utility(self, call: UtilityCall) -> UtilityOutput:
        try:
            return UtilityOutput(call.call_id, result=run_utility(self.engine_core, call.method, call.args))
        except EngineUtilityError as error:
            return UtilityOutput(call.call_id, failure_message=str(error))

    def _input_loop(self, context: zmq.Context, address: str) -> None:
        decoders = {
            RequestType.ADD: msgspec.msgpack.Decoder(EngineCoreRequest),
            RequestType.ABORT: msgspec.msgpack.Decoder(list[str]),
            RequestType.UTILITY: msgspec.msgpack.Decoder(UtilityCall),
        }
        socket = context.socket(zmq.PULL)
        socket.connect(address)
        while True:
            type_frame, payload = socket.recv_multipart(copy=False)
            try:
                request_type = RequestType(type_frame.bytes)
                if request_type == RequestType.SHUTDOWN:
                    self.request_shutdown()
                    return
                self.input_queue.put((request_type, decoders[request_type].decode(payload.buffer)))
            except (ValueError, msgspec.DecodeError) as error:
                logger.error("dropped an undecodable message: %s", error)

    def _output_loop(self, socket: zmq.Socket) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            item = self.output_queue.get()
            if item is None:
                return
            if item is ENGINE_DEAD_SENTINEL:
                socket.send(ENGINE_DEAD_SENTINEL)
                return
            item.engine_index = self.engine_index  # so that a data-parallel front end knows the sender
            socket.send(encoder.encode(item), copy=False)


if __name__ == "__main__":
    main()
