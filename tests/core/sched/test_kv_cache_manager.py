from quire.core.sched.kv_cache_manager import KVCacheManager
from tests.core.sched.helpers import make_request


def test_allocate_slots_adds_only_the_blocks_a_step_needs():
    manager = KVCacheManager(num_blocks=10, block_size=4)
    request = make_request("a", 10)
    assert len(manager.allocate_slots(request, 6)) == 2  # tokens 0..5
    request.num_computed_tokens = 6
    assert len(manager.allocate_slots(request, 2)) == 0  # 6..7 fit in block 2
    request.num_computed_tokens = 8
    assert len(manager.allocate_slots(request, 3)) == 1
    assert len(manager.get_block_ids("a")) == 3
    assert manager.num_free_blocks == 6


def test_allocation_that_does_not_fit_changes_nothing():
    manager = KVCacheManager(num_blocks=4, block_size=4)  # 3 usable blocks
    request = make_request("a", 20)
    assert manager.allocate_slots(request, 13) is None
    assert manager.num_free_blocks == 3
    assert manager.get_block_ids("a") == []


def test_free_returns_unhashed_blocks_to_the_front_head_first():
    manager = KVCacheManager(num_blocks=8, block_size=2, enable_caching=False)
    request = make_request("a", 6)
    first = manager.allocate_slots(request, 6)
    manager.free(request)
    assert manager.num_free_blocks == 7
    # unhashed blocks are pushed to the front one by one in tail-first order: head ends up first
    assert [b.block_id for b in manager.block_pool.free_queue][:3] == first
