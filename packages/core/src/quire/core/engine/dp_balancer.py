"""Which data-parallel engine core a new request goes to, and which one holds a request (pure Python).

An engine's load is the number of requests it holds: waiting plus running, as its last ``SchedulerStats``
said, plus the requests sent to it since that report (which the report could not count yet). A new request
goes to the engine with the lowest load. Ties are broken in rotation, from a cursor that moves past each
chosen engine, so that a burst of requests sent before any report alternates between the engines instead of
piling onto engine 0.

NOTE: a report lags the aborts sent after it (an engine left idle by aborts reports once more, but only
when it has processed them), so it may still count requests that are gone. A load is therefore capped at
the number of requests this client has in flight on that engine: with one front end per engine group, an
engine cannot hold more of ours.
"""

from __future__ import annotations

from quire.core.wire import EngineCoreOutputs, SchedulerStats


class DataParallelBalancer:
    """Picks an engine per request and remembers the choice until the request finishes or is aborted."""

    def __init__(self, num_engines: int):
        if num_engines < 1:
            raise ValueError(f"num_engines must be at least 1, got {num_engines}")
        self.num_engines = num_engines
        self._num_reported = [0] * num_engines  # waiting + running at the engine's last report
        self._num_sent_since_report = [0] * num_engines
        self._num_in_flight = [0] * num_engines
        self._engine_of: dict[str, int] = {}
        self._cursor = 0

    def load(self, engine: int) -> int:
        """The requests ``engine`` holds, as far as this client knows."""
        estimate = self._num_reported[engine] + self._num_sent_since_report[engine]
        return min(estimate, self._num_in_flight[engine])

    def choose(self, request_id: str, pinned_engine: int | None = None) -> int:
        """The engine for a new request (``pinned_engine`` if given, else the least loaded), recorded as
        holding it."""
        if pinned_engine is not None:
            if not 0 <= pinned_engine < self.num_engines:
                raise ValueError(f"engine {pinned_engine} is not in [0, {self.num_engines})")
            engine = pinned_engine
        else:
            # scan from the cursor: on equal loads the first engine in rotation wins
            order = [(self._cursor + offset) % self.num_engines for offset in range(self.num_engines)]
            engine = min(order, key=self.load)
            self._cursor = (engine + 1) % self.num_engines
        self._engine_of[request_id] = engine
        self._num_sent_since_report[engine] += 1
        self._num_in_flight[engine] += 1
        return engine

    def engine_of(self, request_id: str) -> int | None:
        return self._engine_of.get(request_id)

    def record_stats(self, engine: int, stats: SchedulerStats) -> None:
        """An engine's report replaces what was known of its load (and what was sent before it)."""
        self._num_reported[engine] = stats.num_waiting_reqs + stats.num_running_reqs
        self._num_sent_since_report[engine] = 0

    def record_outputs(self, outputs: EngineCoreOutputs) -> None:
        """Learn from one engine's step: its report, and the requests that finished in it."""
        if outputs.scheduler_stats is not None:
            self.record_stats(outputs.engine_index, outputs.scheduler_stats)
        for output in outputs.outputs:
            if output.finish_reason is not None:
                self._forget(output.request_id)

    def forget(self, request_ids: list[str]) -> dict[int, list[str]]:
        """Forget aborted requests; return their ids grouped by the engine that holds them (ids unknown
        here, such as requests that already finished, are left out)."""
        by_engine: dict[int, list[str]] = {}
        for request_id in request_ids:
            engine = self._forget(request_id)
            if engine is not None:
                by_engine.setdefault(engine, []).append(request_id)
        return by_engine

    def _forget(self, request_id: str) -> int | None:
        engine = self._engine_of.pop(request_id, None)
        if engine is not None:
            self._num_in_flight[engine] -= 1
        return engine

    @property
    def num_tracked_requests(self) -> int:
        return len(self._engine_of)
