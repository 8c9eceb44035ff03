"""When a request stops speculating for a while: proposals that are mostly rejected cost a verification step
of ``1 + k`` tokens for about one token of output, which is slower than plain decoding.

Torch-free: the engine core consults it between steps.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class _RequestRecord:
    recent: list[int] = dataclasses.field(default_factory=list)  # accepted tokens of the latest steps
    resume_step: int = 0  # the first engine step in which the request may propose again
    num_pauses: int = 0  # pauses in a row (a good window resets it)


class SpeculationBackoff:
    """Per request: when its last ``window`` verification steps accepted fewer than
    ``min_accepted_per_step`` proposed tokens on average, it decodes without proposals for
    ``pause_steps * 2**n`` engine steps (``n``: pauses in a row before this one; at most ``max_pause_steps``),
    then tries again with a fresh window. A window at or above the mark ends the run of pauses."""

    def __init__(self, window: int = 4, min_accepted_per_step: float = 0.5, pause_steps: int = 8,
                 max_pause_steps: int = 256):
        self.window = window
        self.min_accepted_per_step = min_accepted_per_step
        self.pause_steps = pause_steps
        self.max_pause_steps = max_pause_steps
        self.records: dict[str, _RequestRecord] = {}
        self.num_pauses = 0  # every pause so far, for stats and tests

    def allows(self, request_id: str, step: int) -> bool:
        record = self.records.get(request_id)
        return record is None or step >= record.resume_step

    def record(self, request_id: str, num_accepted: int, step: int) -> None:
        """One verification step of ``request_id`` (during engine step ``step``) kept ``num_accepted``
        proposed tokens."""
        record = self.records.setdefault(request_id, _RequestRecord())
        record.recent.append(num_accepted)
        if len(record.recent) < self.window:
            return
        if sum(record.recent) < self.min_accepted_per_step * self.window:
            pause = min(self.max_pause_steps, self.pause_steps << record.num_pauses)
            record.resume_step = step + 1 + pause
            record.num_pauses += 1
            self.num_pauses += 1
        else:
            record.num_pauses = 0
        record.recent.clear()

    def remove_requests(self, request_ids) -> None:
        for request_id in request_ids:
            self.records.pop(request_id, None)
