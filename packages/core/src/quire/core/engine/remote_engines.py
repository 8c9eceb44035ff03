"""Engine cores that are not the front end's child processes: on other machines (headless launchers) or in
Ray actors.

```
 front end (data-parallel ranks 0 … L-1 local)              other machine: quire serve MODEL --headless
 ┌──────────────────────────────────────────┐   register    ┌─────────────────────────────────────────┐
 │ EngineRegistrar on ADDRESS:RPC_PORT  ◄───┼───────────────┤ run_headless: for each of its ranks,     │
 │   answers each rank with its two TCP     │   rank r      │   ask where to connect, then start an   │
 │   addresses (free ports on ADDRESS)  ────┼──────────────►│   engine-core process on those          │
 │ MPClient(rank r) PUSH/PULL on TCP  ◄─────┼── requests, ──┤ core_proc (rank r) connects, reports    │
 │                                          │   outputs     │   EngineReady, serves                   │
 └──────────────────────────────────────────┘               └─────────────────────────────────────────┘
```

An engine core elsewhere has no process the front end can watch: its death is its TCP connection closing
(or, for a machine lost, ZMQ heartbeats going unanswered for ``HEARTBEAT_TIMEOUT_MS``), which a socket
monitor turns into the same ``poll``/``wait`` a child process offers. The engine core, in turn, exits when
the front end disconnects (``core_proc``). With ``--data-parallel-backend ray`` the front end places every
engine core as a Ray actor (``ray_utils``) that connects the same way, and the actor's end is its death.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import msgspec
import zmq

from quire.core.config import EngineConfig
from quire.core.errors import ConfigError
from quire.core.wire import EngineAssignment, EngineRegistration

logger = logging.getLogger(__name__)

_POLL_MS = 100
REGISTRATION_TIMEOUT_SECONDS = float(os.environ.get("QUIRE_ENGINE_STARTUP_TIMEOUT", "600"))


def tcp_address(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class EngineRegistrar:
    """The front end's RPC port: tells each headless launcher's engine core where to connect.

    ``offer(rank, …)`` (called as each remote rank's client has bound its sockets) makes the rank's addresses
    available; a registration for a rank not offered yet waits for its offer, one for a rank that is not
    remote, or for a group of another size, is refused with the reason."""

    def __init__(self, host: str, port: int, remote_ranks: list[int], data_parallel_size: int):
        self.data_parallel_size = data_parallel_size
        self.remote_ranks = set(remote_ranks)
        self._offers: dict[int, EngineAssignment] = {}
        self._waiting: dict[int, bytes] = {}  # rank -> the launcher's identity, registered before the offer
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 1000)
        self.address = tcp_address(host, port)
        try:
            self._socket.bind(self.address)
        except zmq.ZMQError as error:
            self._socket.close(linger=0)
            self._context.term()
            raise ConfigError(f"cannot listen for headless engine cores at {self.address} "
                              f"(data_parallel_address, data_parallel_rpc_port): {error}") from None
        self._thread = threading.Thread(target=self._serve, name="engine-registrar", daemon=True)
        self._thread.start()
        logger.info("waiting for headless engine cores %s at %s", sorted(self.remote_ranks), self.address)

    def offer(self, rank: int, input_address: str, output_address: str) -> None:
        with self._lock:
            self._offers[rank] = EngineAssignment(input_address, output_address)

    def _serve(self) -> None:
        encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(EngineRegistration)
        while not self._stopping.is_set():
            if self._socket.poll(_POLL_MS):
                identity, payload = self._socket.recv_multipart()
                try:
                    registration = decoder.decode(payload)
                except msgspec.DecodeError as error:
                    logger.error("dropped an undecodable registration: %s", error)
                    continue
                refusal = self._refusal(registration)
                if refusal is not None:
                    logger.error("refused a headless engine core: %s", refusal)
                    self._socket.send_multipart([identity, encoder.encode(EngineAssignment(refusal=refusal))])
                else:
                    self._waiting[registration.rank] = identity
            with self._lock:
                ready = [rank for rank in self._waiting if rank in self._offers]
                for rank in ready:
                    assignment = self._offers.pop(rank)
                    self._socket.send_multipart([self._waiting.pop(rank), encoder.encode(assignment)])
                    self.remote_ranks.discard(rank)
                    logger.info("headless engine core %d registered", rank)

    def _refusal(self, registration: EngineRegistration) -> str | None:
        if registration.data_parallel_size != self.data_parallel_size:
            return (f"the front end serves a data-parallel group of {self.data_parallel_size}, the launcher "
                    f"expects {registration.data_parallel_size} (data_parallel_size)")
        if registration.rank not in self.remote_ranks or registration.rank in self._waiting:
            return (f"data-parallel rank {registration.rank} is not awaited (remote ranks still expected: "
                    f"{sorted(set(self.remote_ranks) - set(self._waiting))}; check data_parallel_start_rank "
                    "and data_parallel_size_local)")
        return None

    def close(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=2)
        self._socket.close(linger=0)
        self._context.term()


class _EngineHandle:
    """What a ``subprocess.Popen``-like handle of an engine core elsewhere shares: its end, once known."""

    def __init__(self, description: str):
        self.description = description
        self.returncode: int | None = None
        self._ended = threading.Event()

    def _end(self, returncode: int) -> None:
        if self.returncode is None:
            self.returncode = returncode
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.description, timeout)
        return self.returncode


class RemoteEngine(_EngineHandle):
    """A ``subprocess.Popen``-like handle of an engine core elsewhere, alive while its connection to the
    front end's output socket is: ``poll`` and ``wait`` report its end, ``terminate`` forgets it (closing
    the sockets, which the client does next, makes the engine core exit)."""

    def __init__(self, output_socket: zmq.Socket, description: str):
        super().__init__(description)
        self._monitor = output_socket.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        threading.Thread(target=self._watch, name="remote-engine-watch", daemon=True).start()

    def _watch(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        try:
            while not self._ended.is_set():
                if self._monitor.poll(_POLL_MS) and recv_monitor_message(self._monitor)["event"] == \
                        zmq.EVENT_DISCONNECTED:
                    self._end(1)
        except zmq.ZMQError:
            self._end(1)  # the client's context is closing
        finally:
            self._monitor.close(linger=0)

    def terminate(self) -> None:
        pass  # the client sent SHUTDOWN; the engine core's disconnection ends the wait

    def kill(self) -> None:
        self._end(-signal.SIGKILL)  # forgotten: closing the sockets makes the engine core exit


class HeadlessEngineLauncher:
    """``MPClient``'s launcher for an engine core that a headless launcher on another machine starts: binds
    TCP sockets on the front end's address and offers them to the registrar under the rank."""

    def __init__(self, registrar: EngineRegistrar, host: str):
        self.registrar = registrar
        self.host = host

    def launch(self, resources, config: EngineConfig) -> RemoteEngine:
        rank = config.parallel.data_parallel_rank
        handle = RemoteEngine(resources.output_socket, f"{rank} (headless)")
        self.registrar.offer(rank, resources.input_address, resources.output_address)
        return handle


class RayEngineLauncher:
    """``MPClient``'s launcher for an engine core in a Ray actor, placed by Ray on any node with the CPUs."""

    host: str

    def __init__(self):
        from quire.core.distributed.ray_utils import ensure_ray_initialized

        self.ray = ensure_ray_initialized()
        self.host = self.ray.util.get_node_ip_address()
        self.actor_class = self.ray.remote(max_restarts=0)(EngineCoreActor)

    def launch(self, resources, config: EngineConfig) -> RayEngine:
        from quire.core.engine.mp_client import engine_environment

        actor = self.actor_class.options(
            num_cpus=config.num_threads or 1, scheduling_strategy="SPREAD",
            runtime_env={"env_vars": {key: value for key, value in engine_environment().items()
                                      if key.startswith(("GOMP_", "OMP_", "QUIRE_", "GLIBC_"))}},
        ).remote()
        run = actor.run.remote(msgspec.msgpack.encode(config), resources.input_address, resources.output_address)
        return RayEngine(self.ray, actor, run, f"{config.parallel.data_parallel_rank} (Ray actor)")


class EngineCoreActor:
    """The Ray actor that serves one engine core (``run`` returns when the engine core ends)."""

    def run(self, encoded_config: bytes, input_address: str, output_address: str) -> int:
        from quire.core.engine.core_proc import configure_logging, serve_engine_core

        configure_logging()
        config = msgspec.msgpack.decode(encoded_config, type=EngineConfig)
        return serve_engine_core(config, input_address, output_address)


class RayEngine(_EngineHandle):
    """A ``subprocess.Popen``-like handle of an engine core in a Ray actor: it ends when ``run`` returns or the
    actor dies."""

    def __init__(self, ray, actor, run, description: str):
        super().__init__(description)
        self._ray, self._actor, self._run = ray, actor, run
        threading.Thread(target=self._watch, name="ray-engine-watch", daemon=True).start()

    def _watch(self) -> None:
        while not self._ended.is_set():
            done, _ = self._ray.wait([self._run], timeout=_POLL_MS / 1000)
            if done:
                try:
                    code = self._ray.get(done[0])
                except Exception as error:  # noqa: BLE001 - the actor died: a death like any other
                    logger.error("engine core %s: %s", self.description, error)
                    code = 1
                else:
                    self._ray.kill(self._actor, no_restart=True)  # its work is done: free its CPUs
                self._end(code)

    def terminate(self) -> None:
        pass  # the client sent SHUTDOWN: ``run`` returns

    def kill(self) -> None:
        self._ray.kill(self._actor, no_restart=True)
        self._end(-signal.SIGKILL)


def register_with_front_end(config: EngineConfig, rank: int, timeout: float = REGISTRATION_TIMEOUT_SECONDS
                            ) -> EngineAssignment:
    """Ask the front end at ``data_parallel_address:data_parallel_rpc_port`` where engine core ``rank``
    connects (waiting for the front end to come up, at most ``timeout`` seconds)."""
    parallel = config.parallel
    address = tcp_address(parallel.data_parallel_address, parallel.data_parallel_rpc_port)
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(address)
        socket.send(msgspec.msgpack.encode(EngineRegistration(rank, parallel.data_parallel_size)))
        logger.info("engine core %d: registering with the front end at %s", rank, address)
        if not socket.poll(int(timeout * 1000)):
            raise ConfigError(f"the front end at {address} did not answer within {timeout:.0f} s")
        assignment = msgspec.msgpack.decode(socket.recv(), type=EngineAssignment)
    finally:
        socket.close(linger=0)
        context.term()
    if assignment.refusal is not None:
        raise ConfigError(f"the front end at {address} refused engine core {rank}: {assignment.refusal}")
    return assignment


def run_headless(config: EngineConfig) -> int:
    """``quire serve MODEL --headless``: start this machine's engine cores (ranks ``data_parallel_start_rank``
    on, ``data_parallel_size_local`` of them), each connected to the front end once it has registered, and
    wait for them; returns the exit code (that of the first engine core to end, the others are stopped)."""
    from quire.core.engine.mp_client import engine_environment

    parallel = config.parallel
    ranks = range(parallel.data_parallel_start_rank, parallel.data_parallel_start_rank + parallel.num_local_engines)
    if not ranks:
        raise ConfigError("a headless launcher needs engine cores to run (data_parallel_size_local >= 1)")
    processes: list[subprocess.Popen] = []
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    try:
        for rank in ranks:
            assignment = register_with_front_end(config, rank)
            process = subprocess.Popen(
                [sys.executable, "-m", "quire.core.engine.core_proc", assignment.input_address,
                 assignment.output_address, str(os.getpid())], stdin=subprocess.PIPE, env=engine_environment())
            process.stdin.write(msgspec.msgpack.encode(config.for_data_parallel_rank(rank)))
            process.stdin.close()
            processes.append(process)
        logger.info("headless: engine cores %s running", list(ranks))
        while not stopping.is_set():
            ended = [process for process in processes if process.poll() is not None]
            if ended:
                code = ended[0].returncode
                logger.log(logging.INFO if code == 0 else logging.ERROR,
                           "headless: an engine core ended (exit code %s); stopping the others", code)
                return code
            time.sleep(_POLL_MS / 1000)
        return 0
    finally:
        for process in processes:
            if process.poll() is None:
                process.terminate()
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
