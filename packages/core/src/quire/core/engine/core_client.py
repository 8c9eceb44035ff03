"""How a front end reaches an ``EngineCore``. ``InprocClient`` holds one in the same process."""

from __future__ import annotations

import abc

from quire.core.config import EngineConfig
from quire.core.wire import EngineCoreOutputs, EngineCoreRequest


class EngineCoreClient(abc.ABC):
    """The front end's handle on an engine core, wherever that core runs.

    ``get_output`` returns the next step's outputs (running a step if the core is in-process).
    ``num_blocks`` and ``max_model_len`` are the limits the core reported once it was ready.
    """

    num_blocks: int
    max_model_len: int

    @abc.abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abc.abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abc.abstractmethod
    def get_output(self) -> EngineCoreOutputs: ...

    @abc.abstractmethod
    def reset_prefix_cache(self) -> bool: ...

    @abc.abstractmethod
    def shutdown(self) -> None: ...


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

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def shutdown(self) -> None:
        pass
