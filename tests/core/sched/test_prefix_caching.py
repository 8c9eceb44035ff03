"""Prefix caching in the KV-cache manager and the scheduler (pure Python)."""

import hashlib
import struct

from quire.core.sched.block_hash import ROOT_HASH, hash_block
from quire.core.sched.kv_cache_manager import KVCacheManager
from tests.core.sched.helpers import make_request, make_scheduler, run_step

BLOCK = 4


def prompt(n, start=100):
    return list(range(start, start + n))


def admit(manager, request):
    """What the scheduler does for a waiting request: look up hits, then allocate the rest."""
    hits, num_cached = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_cached, hits) is not None
    manager.record_lookup(request.num_tokens, num_cached)
    request.num_computed_tokens = request.num_tokens
    return hits, num_cached


def test_chained_hashes_follow_the_documented_formula():
    tokens = prompt(8)
    first = hashlib.sha256(hashlib.sha256(b"quire-prefix-cache").digest()
                           + struct.pack("<4I", *tokens[:4]) + b"salt:pepper").digest()
    second = hashlib.sha256(first + struct.pack("<4I", *tokens[4:])).digest()
    assert hash_block(None, tokens[:4], "pepper") == first
    assert hash_block(first, tokens[4:]) == second
    manager = KVCacheManager(16, BLOCK)
    request = make_request("a", prompt=tokens + [1], cache_salt="pepper")
    admit(manager, request)
    assert request.block_hashes == [first, second]
    assert ROOT_HASH == hashlib.sha256(b"quire-prefix-cache").digest()


def test_second_request_hits_the_shared_three_block_prefix():
    manager = KVCacheManager(32, BLOCK)
    shared = prompt(12)
    first = make_request("a", prompt=shared + [1, 2])
    admit(manager, first)
    second = make_request("b", prompt=shared + [3, 4, 5])
    hits, num_cached = admit(manager, second)
    assert num_cached == 12 and [b.block_id for b in hits] == manager.get_block_ids("a")[:3]
    assert all(block.ref_cnt == 2 for block in hits)
    assert manager.prefix_cache_hits == 12 and manager.prefix_cache_queries == 14 + 15


def test_the_last_prompt_token_is_always_recomputed():
    manager = KVCacheManager(32, BLOCK)
    admit(manager, make_request("a", prompt=prompt(12)))
    _, num_cached = admit(manager, make_request("b", prompt=prompt(12)))
    assert num_cached == 8  # the third block holds the last token: it is computed again


def test_a_prompt_shorter_than_a_block_never_hits():
    manager = KVCacheManager(32, BLOCK)
    admit(manager, make_request("a", prompt=prompt(3)))
    assert admit(manager, make_request("b", prompt=prompt(3)))[1] == 0
    assert manager.block_pool.cached_blocks == {}


def test_a_salt_makes_identical_prompts_miss():
    manager = KVCacheManager(32, BLOCK)
    admit(manager, make_request("a", prompt=prompt(9), cache_salt="alice"))
    assert admit(manager, make_request("b", prompt=prompt(9), cache_salt="bob"))[1] == 0
    assert admit(manager, make_request("c", prompt=prompt(9), cache_salt="alice"))[1] == 8
    assert admit(manager, make_request("d", prompt=prompt(9)))[1] == 0


def test_free_list_order_after_freeing():
    manager = KVCacheManager(10, BLOCK)  # blocks 1..9 usable
    request = make_request("a", prompt=prompt(10))  # 2 full blocks (hashed) + 1 partial
    admit(manager, request)
    full_1, full_2, partial = manager.get_block_ids("a")
    manager.free(request)
    order = [b.block_id for b in manager.block_pool.free_queue]
    # the partial block goes to the front; never-used blocks stay; hashed blocks go to the back,
    # the request's tail before its head
    assert order == [partial, 4, 5, 6, 7, 8, 9, full_2, full_1]


def test_eviction_on_a_miss_follows_the_free_list_order():
    manager = KVCacheManager(6, BLOCK)  # 5 usable blocks
    first = make_request("a", prompt=prompt(12) + [0])  # 3 hashed blocks + 1 partial
    admit(manager, first)
    hashed = manager.get_block_ids("a")[:3]
    old_hashes = [manager.block_pool.blocks[i].block_hash for i in hashed]
    manager.free(first)
    # free list: [partial, never-used, hashed tail..head]; a miss needing 3 blocks takes the partial,
    # the never-used block, then evicts the tail of the old prompt
    other = make_request("b", prompt=prompt(12, start=500))
    admit(manager, other)
    assert manager.get_block_ids("b")[2] == hashed[2]
    cached = manager.block_pool.cached_blocks
    assert [h in cached for h in old_hashes] == [True, True, False]
    # the surviving head of the old prompt still hits
    manager.free(other)
    assert admit(manager, make_request("c", prompt=prompt(12) + [7]))[1] == 8


def test_generated_tokens_become_cacheable_as_their_blocks_fill():
    scheduler = make_scheduler(block_size=BLOCK, enable_caching=True)
    scheduler.add_request(make_request("a", prompt=prompt(6), max_tokens=6, ignore_eos=True))
    generated = []
    for _ in range(6):
        _, outputs = run_step(scheduler, token=lambda r: 40 + r.num_output_tokens)
        generated += [t for o in outputs for t in o.new_token_ids]
    assert len(generated) == 6
    manager = scheduler.kv_cache_manager
    follow_up = make_request("b", prompt=prompt(6) + generated[:5] + [1])
    _, num_cached = manager.get_computed_blocks(follow_up)
    assert num_cached == 8  # prompt and generated tokens of the first two blocks (12 tokens: 3rd was
    # still being filled when the request finished after 6 tokens)


def test_scheduler_reports_cached_tokens_and_skips_them():
    scheduler = make_scheduler(block_size=BLOCK, enable_caching=True)
    scheduler.add_request(make_request("a", prompt=prompt(10), max_tokens=1))
    run_step(scheduler)
    scheduler.add_request(make_request("b", prompt=prompt(10) + [9, 9], max_tokens=1))
    out, outputs = run_step(scheduler)
    (new,) = out.new_requests
    assert new.num_computed_tokens == 8 and out.num_scheduled_tokens == {"b": 4}
    assert outputs[0].num_cached_tokens == 8
    stats = scheduler.make_stats()
    assert stats.prefix_cache_hits == 8 and stats.prefix_cache_queries == 22


def test_reset_prefix_cache_is_refused_while_blocks_are_in_use():
    manager = KVCacheManager(16, BLOCK)
    request = make_request("a", prompt=prompt(9))
    admit(manager, request)
    assert not manager.reset_prefix_cache()
    manager.free(request)
    assert manager.reset_prefix_cache()
    assert manager.block_pool.cached_blocks == {}
    assert admit(manager, make_request("b", prompt=prompt(9)))[1] == 0
