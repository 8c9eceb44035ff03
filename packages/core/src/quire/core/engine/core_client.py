"""How a front end reaches an ``EngineCore``. ``InprocClient`` holds one in the same process."""

from __future__ import annotations

import abc

from quire.core.config import EngineConfig
from quire.core.errors import EngineUtilityError
from quire.core.wire import EngineCoreOutputs, EngineCoreRequest

# The engine core's methods a front end may call by name (nothing arbitrary crosses the boundary).
UTILITY_METHODS = frozenset({"reset_prefix_cache", "get_stats", "check_idle_invariants", "get_step_timings"})


def run_utility(engine_core, method: str, args) -> object:
    """Call a utility method on an in-process ``EngineCore``; any failure is an ``EngineUtilityError``
    (the same type the multiprocess clients raise from the engine's answer)."""
    if method not in UTILITY_METHODS:
        raise EngineUtilityError(f"unknown utility method {method!r}")
    try:
        return getattr(engine_core, method)(*args)
    except Exception as error:  # noqa: BLE001 - reported to the caller with its cause
        raise EngineUtilityError(f"{method} failed: {type(error).__name__}: {error}") from error


class EngineCoreClient(abc.ABC):
    """The front end's handle on an engine core, wherever that core runs.

    ``get_output`` returns the next step's outputs (running a step if the core is in-process).
    ``num_blocks`` and ``max_model_len`` are the limits the core reported once it was ready.
    """

    num_blocks: int
    max_model_len: int
    engine_dead: bool = False

    @abc.abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abc.abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abc.abstractmethod
    def get_output(self) -> EngineCoreOutputs: ...

    @abc.abstractmethod
    def call_utility(self, method: str, *args):
        """Call one of the engine core's ``UTILITY_METHODS`` and return its result; raises
        ``EngineUtilityError`` if it fails."""

    @abc.abstractmethod
    def shutdown(self) -> None: ...


class AsyncOnlyClient(EngineCoreClient):
    """Base of the asyncio clients: the synchronous interface is not available on them."""

    def add_request(self, request):
        raise TypeError("use add_request_async with an asyncio engine-core client")

    def abort_requests(self, request_ids):
        raise TypeError("use abort_requests_async with an asyncio engine-core client")

    def get_output(self):
        raise TypeError("use get_output_async with an asyncio engine-core client")

    def call_utility(self, method, *args):
        raise TypeError("use call_utility_async with an asyncio engine-core client")


class InprocClient(EngineCoreClient):
    """Runs the engine core in the caller's process and thread (tests, simple scripts)."""

    def __init__(self, config: EngineConfig):
        from quire.core.engine.core import EngineCore

        self.engine_core = EngineCore(config)
        self.num_blocks = self.engine_core.num_blocks
        self.max_model_len = config.model.max_model_len

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def call_utility(self, method: str, *args):
        return run_utility(self.engine_core, method, args)

    def shutdown(self) -> None:
        self.engine_core.shutdown()  # stops the executor's workers, if it has any
