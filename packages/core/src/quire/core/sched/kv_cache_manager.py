"""Which blocks each request holds, allocation of slots for a step, and prefix-cache lookups."""

from __future__ import annotations

from quire.core.request import Request
from quire.core.sched.block_hash import extend_block_hashes
from quire.core.sched.block_pool import BlockPool, KVBlock


class KVCacheManager:
    """Maps request ids to their block lists over one ``BlockPool``.

    With prefix caching on, every full block a request computes is registered under its chained hash
    (``quire.core.sched.block_hash``), and a new request starts from its longest run of cached full
    blocks, always leaving its last token to compute (its logits are needed).

    With a ``sliding_window`` (every layer of the model attends within it), a request's blocks that lie wholly
    before the window of its next token are released as it grows: the pool gets them back (cached ones keep
    their hash), and the request's list keeps their places as the null block, so block ``i`` still holds
    tokens ``i * block_size ..``. The lookup above still walks from the first block: a prefix whose early
    blocks were evicted is a miss even where the request would not read them (correct, not the most hits).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self._num_hashed_blocks: dict[str, int] = {}
        self._num_released_blocks: dict[str, int] = {}  # leading null entries of each windowed request
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The request's longest cached prefix of full blocks, and how many tokens it covers."""
        if not self.enable_caching or request.skip_prefix_cache:
            return [], 0
        hashes = self._block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_lookup(self, num_tokens: int, num_cached_tokens: int) -> None:
        """Count one admitted request's prefix-cache lookup (not the retries of a request that waits)."""
        if self.enable_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_cached_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] = ()) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones (and after
        ``computed_blocks``, cache hits the request takes on); return the ids of freshly allocated blocks.

        Returns None when there are not enough free blocks, changing nothing but the release of blocks that
        fell out of the sliding window (which the request never reads again).
        """
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_tokens = num_computed + num_new_tokens
        # NOTE: slots past the known tokens (speculative proposals) are held but never hashed: only blocks
        # of known tokens enter the prefix cache
        num_known = min(num_tokens, request.num_tokens)
        num_skipped = 0
        if self.sliding_window is not None:
            num_outside = max(0, num_computed - self.sliding_window + 1) // self.block_size
            self._release_outside_window(request, blocks, num_outside)
            # hits wholly before the window are not taken: the request never reads them
            num_skipped = min(max(0, num_outside - len(blocks)), len(computed_blocks))
            computed_blocks = computed_blocks[num_skipped:]
        if not computed_blocks and not num_skipped and num_tokens <= len(blocks) * self.block_size:
            # the common decode step: the last block still has room
            if self.enable_caching and num_known // self.block_size > self._num_hashed_blocks.get(
                    request.request_id, 0):
                self._cache_full_blocks(request, blocks, num_known)
            return []
        num_needed = -(-num_tokens // self.block_size)
        num_new_blocks = max(0, num_needed - len(blocks) - num_skipped - len(computed_blocks))
        # hits sitting in the free list stop being free once taken
        num_free = self.block_pool.num_free_blocks - sum(b.ref_cnt == 0 for b in computed_blocks)
        if num_new_blocks > num_free:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.block_pool.touch(computed_blocks)
        if num_skipped:
            blocks.extend([self.block_pool.null_block] * num_skipped)
            self._num_released_blocks[request.request_id] = num_skipped
        blocks.extend(computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, num_known)
        return [block.block_id for block in new_blocks]

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def num_released_blocks(self, request_id: str) -> int:
        """How many leading blocks of the request's list it no longer holds (null blocks, sliding window)."""
        return self._num_released_blocks.get(request_id, 0)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its tail is evicted before its head."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._num_hashed_blocks.pop(request.request_id, None)
        num_released = self._num_released_blocks.pop(request.request_id, 0)
        self.block_pool.free_blocks(reversed(blocks[num_released:]))

    def _release_outside_window(self, request: Request, blocks: list[KVBlock], num_outside: int) -> None:
        """Release the request's blocks before index ``num_outside`` that it still holds, registering them in
        the prefix cache first (their tokens are known, though speculative steps may have left them unhashed),
        and put the null block in their places."""
        request_id = request.request_id
        first = self._num_released_blocks.get(request_id, 0)
        end = min(num_outside, len(blocks))
        if end <= first:
            return
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, min(request.num_computed_tokens, request.num_tokens))
        released = blocks[first:end]
        blocks[first:end] = [self.block_pool.null_block] * (end - first)
        self._num_released_blocks[request_id] = end
        self.block_pool.free_blocks(reversed(released))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def _block_hashes(self, request: Request) -> list[bytes]:
        return extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size,
                                   request.cache_salt, request.mm_features, request.lora_request)

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        # NOTE: blocks are registered when their slots are allocated, before the step computes them;
        # a request reading them later in the same step is still correct, because every layer writes
        # the whole batch's keys and values before any request attends.
        start = self._num_hashed_blocks.get(request.request_id, 0)
        num_full = num_tokens // self.block_size
        if num_full <= start:
            return
        hashes = self._block_hashes(request)
        null_block = self.block_pool.null_block
        for index in range(start, num_full):
            block = blocks[index]
            if block.block_hash is None and block is not null_block:  # a hit skipped before the window: null
                self.block_pool.cache_block(block, hashes[index])
        self._num_hashed_blocks[request.request_id] = num_full
