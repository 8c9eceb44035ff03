"""Waiting queues and preemption choices of the two scheduling policies (FCFS and priority)."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from quire.core.request import Request


class FCFSQueue:
    """First come, first served; preempted requests go back to the front."""

    def __init__(self):
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def add_preempted(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    @staticmethod
    def select_victim(running: list[Request]) -> Request:
        """The latest-admitted running request."""
        return running[-1]


class PriorityQueue:
    """Lowest ``priority`` value first, then earliest arrival."""

    def __init__(self):
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._counter), request))

    add_preempted = add

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap))

    @staticmethod
    def select_victim(running: list[Request]) -> Request:
        """The running request with the highest priority value (latest arrival on ties)."""
        return max(running, key=lambda r: (r.priority, r.arrival_time))


POLICIES = {"fcfs": FCFSQueue, "priority": PriorityQueue}


def make_request_queue(policy: str) -> FCFSQueue | PriorityQueue:
    if policy not in POLICIES:
        raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}; got {policy!r}")
    return POLICIES[policy]()
