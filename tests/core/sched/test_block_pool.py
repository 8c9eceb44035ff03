import pytest

from quire.core.sched.block_pool import BlockPool, FreeBlockQueue, KVBlock


def ids(blocks):
    return [block.block_id for block in blocks]


def test_free_queue_pops_front_appends_both_ends_and_removes_in_the_middle():
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks[:3])
    queue.append(blocks[3])
    queue.appendleft(blocks[4])
    assert ids(queue) == [4, 0, 1, 2, 3]
    queue.remove(blocks[1])
    assert ids(queue) == [4, 0, 2, 3]
    assert queue.popleft() is blocks[4]
    assert queue.num_free_blocks == 3
    for _ in range(3):
        queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()


def test_block_zero_is_reserved_and_never_handed_out():
    pool = BlockPool(5)
    assert pool.num_free_blocks == 4
    blocks = pool.get_new_blocks(4)
    assert 0 not in ids(blocks)
    assert all(block.ref_cnt == 1 for block in blocks)
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    assert pool.usage == 1.0


def test_freed_blocks_without_hash_go_to_the_front_with_hash_to_the_back():
    pool = BlockPool(6)
    a, b, c = pool.get_new_blocks(3)  # blocks 1, 2, 3; 4 and 5 stay free
    b.block_hash = b"hash-b"
    pool.free_blocks([a, b, c])
    assert ids(pool.free_queue) == [3, 1, 4, 5, 2]


def test_blocks_with_references_left_stay_allocated():
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    block.ref_cnt += 1  # shared by a second request
    pool.free_blocks([block])
    assert pool.num_free_blocks == 1
    pool.free_blocks([block])
    assert pool.num_free_blocks == 2
