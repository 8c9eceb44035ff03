"""Which blocks each request holds, and allocation of slots for the tokens a step will compute."""

from __future__ import annotations

from quire.core.request import Request
from quire.core.sched.block_pool import BlockPool, KVBlock


class KVCacheManager:
    """Maps request ids to their block lists over one ``BlockPool``."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Make room for ``num_new_tokens`` more computed tokens; return the new block ids.

        Returns None, changing nothing, when there are not enough free blocks.
        """
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_needed = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
        num_new_blocks = num_needed - len(blocks)
        if num_new_blocks <= 0:
            return []
        if num_new_blocks > self.block_pool.num_free_blocks:
            return None
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)
        return [block.block_id for block in new_blocks]

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its tail is evicted before its head."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(reversed(blocks))
