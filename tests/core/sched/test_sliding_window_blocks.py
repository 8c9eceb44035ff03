"""A KV-cache manager for a model whose every layer attends within a sliding window releases the blocks that
fall wholly before the window of a request's next token, keeping their places as the null block."""

from quire.core.config import SchedulerConfig
from quire.core.sched.kv_cache_manager import KVCacheManager
from quire.core.sched.scheduler import Scheduler
from tests.core.sched.helpers import make_request, run_step


def grow(manager, request, num_tokens, step=1):
    """Compute ``num_tokens`` tokens ``step`` at a time, as decode steps would."""
    for _ in range(0, num_tokens, step):
        assert manager.allocate_slots(request, step) is not None
        request.num_computed_tokens += step


def test_blocks_before_the_window_are_released_as_the_request_grows():
    manager = KVCacheManager(num_blocks=32, block_size=4, enable_caching=False, sliding_window=6)
    request = make_request("a", 60)
    grow(manager, request, 40)
    # the last step's token, at position 39, sees 34..39: blocks 0..7 (positions 0..31) are released, blocks 8
    # and 9 held
    assert manager.num_released_blocks("a") == 8
    ids = manager.get_block_ids("a")
    assert ids[:8] == [0] * 8 and 0 not in ids[8:] and len(ids) == 10
    assert manager.num_free_blocks == 31 - 2
    manager.free(request)
    assert manager.num_free_blocks == 31  # nothing released twice, the null block never freed
    assert manager.num_released_blocks("a") == 0


def test_a_windowed_request_holds_a_bounded_number_of_blocks():
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True, sliding_window=9)
    request = make_request("a", 200)
    held = []
    for _ in range(200):
        assert manager.allocate_slots(request, 1) is not None  # 7 usable blocks are enough forever
        request.num_computed_tokens += 1
        held.append(len(manager.get_block_ids("a")) - manager.num_released_blocks("a"))
    # a decode sees 9 keys, which span at most 3 blocks of 4
    assert max(held) == 3


def test_plain_manager_releases_nothing():
    manager = KVCacheManager(num_blocks=32, block_size=4, enable_caching=False)
    request = make_request("a", 60)
    grow(manager, request, 40)
    assert manager.num_released_blocks("a") == 0 and 0 not in manager.get_block_ids("a")


def test_prefix_hits_before_the_window_are_not_taken():
    manager = KVCacheManager(num_blocks=40, block_size=4, enable_caching=True, sliding_window=6)
    first = make_request("a", 41)
    assert manager.allocate_slots(first, 41) is not None
    first.num_computed_tokens = 41
    held_by_first = set(manager.get_block_ids("a"))
    second = make_request("b", 41)
    hits, num_cached = manager.get_computed_blocks(second)
    assert num_cached == 40
    num_free = manager.num_free_blocks
    assert len(manager.allocate_slots(second, 1, hits)) == 1
    second.num_computed_tokens = 40
    ids = manager.get_block_ids("b")
    # position 40 sees 35..40: blocks 0..7 are skipped (null), blocks 8 and 9 shared, block 10 is new
    assert ids[:8] == [0] * 8 and set(ids[8:10]) <= held_by_first and manager.num_released_blocks("b") == 8
    assert manager.num_free_blocks == num_free - 1  # only the new block: the skipped hits were never taken
    assert manager.block_pool.null_block.block_hash is None and manager.block_pool.null_block.ref_cnt == 0


def test_released_blocks_stay_in_the_prefix_cache():
    manager = KVCacheManager(num_blocks=40, block_size=4, enable_caching=True, sliding_window=6)
    first = make_request("a", 41)
    grow(manager, first, 40, step=8)
    assert manager.num_released_blocks("a") > 0
    manager.free(first)
    second = make_request("b", 41)
    hits, num_cached = manager.get_computed_blocks(second)
    assert num_cached == 40  # the released blocks were registered before release, and are still free


def test_scheduler_tells_the_runner_how_many_leading_blocks_were_released():
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=16), KVCacheManager(16, 4, sliding_window=5), 64)
    scheduler.add_request(make_request("a", 12, max_tokens=30, ignore_eos=True))
    released = []
    for _ in range(20):
        output, _ = run_step(scheduler)
        released += [data.num_released_blocks for data in output.cached_requests]
    # the second step decodes position 12, which sees 8..12: blocks 0 and 1 are released; the last, at 30
    assert released[0] == 2 and released == sorted(released) and released[-1] == (30 - 5 + 1) // 4
