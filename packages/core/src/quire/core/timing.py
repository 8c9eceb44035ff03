"""Cumulative time per phase of engine steps, for the benchmarks' per-step breakdown (no torch here)."""

from __future__ import annotations

import time

ENGINE_PHASES = ("schedule", "prepare_inputs", "forward", "sampling", "update")


class StepTimings:
    """Seconds spent in each phase since the last ``reset``; ``mark`` closes the current phase."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.totals = dict.fromkeys(ENGINE_PHASES, 0.0)
        self.num_steps = 0
        self._last = time.perf_counter()

    def start(self) -> None:
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.totals[phase] += now - self._last
        self._last = now

    def snapshot(self) -> dict:
        return {"num_steps": self.num_steps, **self.totals}
