"""Test-only fault injection, enabled by the ``QUIRE_TEST_FAULTS`` environment variable.

Production never sets it. The value is comma-separated ``name=value`` pairs:

- ``fail_after_steps=N``: the engine core raises during its N-th step (the engine dies);
- ``step_delay_ms=N``: every engine step sleeps N milliseconds first (to hold requests in flight);
- ``load_delay_ms=N``: the engine sleeps N milliseconds before it loads the model (to observe start-up);
- ``fail_request=TEXT``: a request whose id contains TEXT fails on arrival (that request alone: the engine
  stays up and the others go on);
- ``script_output=ID.ID.ID``: every request's output is these token ids in turn (then the last one again),
  whatever the model samples, so tests can put chosen text (split multi-byte characters, stop strings
  across tokens) through the whole output path. The model still computes on its own samples, so the
  prefix cache of such an engine is not to be trusted.
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
    load_delay_ms: float = 0.0
    fail_request: str | None = None
    script_output: tuple[int, ...] = ()

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
            load_delay_ms=float(values.get("load_delay_ms", 0.0)),
            fail_request=values.get("fail_request") or None,
            script_output=tuple(int(i) for i in values.get("script_output", "").split(".") if i),
        )

    @property
    def enabled(self) -> bool:
        return self != Faults()

    def before_load(self) -> None:
        if self.load_delay_ms:
            time.sleep(self.load_delay_ms / 1000)

    def check_request(self, request_id: str) -> None:
        if self.fail_request is not None and self.fail_request in request_id:
            raise InjectedFault(f"fault injected by {ENV_VAR} for request {request_id!r}")

    def rewrite_samples(self, sampled_token_ids: dict[str, list[int]], requests: dict) -> None:
        """Replace each request's sampled tokens by the script at its output position."""
        if not self.script_output:
            return
        last = len(self.script_output) - 1
        for request_id, token_ids in sampled_token_ids.items():
            request = requests.get(request_id)
            if request is None:
                continue  # aborted while the step ran
            start = request.num_output_tokens
            token_ids[:] = [self.script_output[min(start + i, last)] for i in range(len(token_ids))]

    def before_step(self, step_number: int) -> None:
        if self.step_delay_ms:
            time.sleep(self.step_delay_ms / 1000)
        if self.fail_after_steps is not None and step_number >= self.fail_after_steps:
            raise InjectedFault(f"fault injected by {ENV_VAR} at step {step_number}")
