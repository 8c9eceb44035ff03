"""Which multimodal items' encoder outputs the model runner holds, and the encoder work of one step.

The runner keeps each item's encoder output (``[length, hidden]``, keyed by the item's content hash) from
the step that computes it until the scheduler lets it go. An item is *referenced* by every request whose
prompt still has placeholder tokens of it to compute; an unreferenced output stays cached (a later request
with the same image reuses it) until its room is needed, and is then freed, oldest first. Sizes count
embedding rows (placeholder tokens). This module imports no torch.
"""

from __future__ import annotations

from collections import OrderedDict

from quire.core.request import Request


class EncoderCacheManager:
    """Room for ``capacity`` embedding rows of encoder outputs, shared by all requests.

    One item larger than ``capacity`` may still be held when nothing else is, so no image is too large to
    ever run (the front end limits image sizes).
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.num_used = 0
        self._sizes: dict[str, int] = {}
        self._referrers: dict[str, set[str]] = {}
        self._unreferenced: OrderedDict[str, None] = OrderedDict()  # cached, evictable, oldest first
        self._freed: list[str] = []  # evicted since the last step, for the runner to drop
        self.num_queries = 0  # items whose encoder output a step needed
        self.num_hits = 0  # those already cached

    def is_cached(self, identifier: str) -> bool:
        return identifier in self._sizes

    def is_referenced_by(self, request: Request, identifier: str) -> bool:
        return request.request_id in self._referrers.get(identifier, ())

    def take_hit(self, request: Request, identifier: str) -> None:
        """``request`` uses the cached output of an item (one query and one hit counted)."""
        self.num_queries += 1
        self.num_hits += 1
        self._reference(request.request_id, identifier)

    def can_allocate(self, size: int) -> bool:
        """Whether ``size`` more rows fit once unreferenced outputs are evicted (always, when nothing is
        referenced)."""
        evictable = sum(self._sizes[i] for i in self._unreferenced)
        return size <= self.capacity - self.num_used + evictable or self.num_used == evictable

    def allocate(self, request: Request, identifier: str, size: int) -> None:
        """Make room (evicting unreferenced outputs, oldest first) for an item the runner computes now (one
        query counted)."""
        self.num_queries += 1
        while self._unreferenced and self.num_used + size > self.capacity:
            evicted, _ = self._unreferenced.popitem(last=False)
            self.num_used -= self._sizes.pop(evicted)
            del self._referrers[evicted]
            self._freed.append(evicted)
        self._sizes[identifier] = size
        self._referrers[identifier] = set()
        self.num_used += size
        self._reference(request.request_id, identifier)

    def release(self, request: Request, identifier: str) -> None:
        """``request`` no longer needs the item (its placeholders are computed, or it left)."""
        referrers = self._referrers.get(identifier)
        if referrers is None or request.request_id not in referrers:
            return
        referrers.discard(request.request_id)
        if not referrers:
            self._unreferenced[identifier] = None

    def release_all(self, request: Request) -> None:
        for feature in request.mm_features:
            self.release(request, feature.identifier)

    def forget(self, identifier: str) -> None:
        """Drop an item allocated for a step that will not encode it, unless another request uses it (the
        runner then encodes it when that request needs it)."""
        if identifier in self._unreferenced:
            del self._unreferenced[identifier]
            del self._referrers[identifier]
            self.num_used -= self._sizes.pop(identifier)

    def take_freed(self) -> list[str]:
        """Identifiers evicted since the last call: the runner drops their outputs."""
        freed, self._freed = self._freed, []
        return freed

    @property
    def num_referenced(self) -> int:
        return len(self._sizes) - len(self._unreferenced)

    def _reference(self, request_id: str, identifier: str) -> None:
        self._referrers[identifier].add(request_id)
        self._unreferenced.pop(identifier, None)
