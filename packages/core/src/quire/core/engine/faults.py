"""Test-only fault injection, enabled by the ``QUIRE_TEST_FAULTS`` environment variable.

Production never sets it. The value is comma-separated ``name=value`` pairs:

- ``fail_after_steps=N``: the engine core raises during its N-th step (the engine dies);
- ``step_delay_ms=N``: every engine step sleeps N milliseconds first (to hold requests in flight).
"""

from __future__ import annotations

import dataclasses
import os
import time

ENV_VAR = "QUIRE_TEST_FAULTS"


class InjectedFault(RuntimeError):
    """Raised on purpose by a fault hook."""


@dataclasses.dataclass(frozen=True)
class Faults:
    fail_after_steps: int | None = None
    step_delay_ms: float = 0.0

    @classmethod
    def from_env(cls) -> Faults:
        spec = os.environ.get(ENV_VAR, "").strip()
        if not spec:
            return cls()
        values = dict(item.split("=", 1) for item in spec.split(",") if item)
        unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown {ENV_VAR} entries: {sorted(unknown)}")
        return cls(
            fail_after_steps=int(values["fail_after_steps"]) if "fail_after_steps" in values else None,
            step_delay_ms=float(values.get("step_delay_ms", 0.0)),
        )

    @property
    def enabled(self) -> bool:
        return self != Faults()

    def before_step(self, step_number: int) -> None:
        if self.step_delay_ms:
            time.sleep(self.step_delay_ms / 1000)
        if self.fail_after_steps is not None and step_number >= self.fail_after_steps:
            raise InjectedFault(f"fault injected by {ENV_VAR} at step {step_number}")
