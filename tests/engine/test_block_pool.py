"""BlockPool and hash_block_tokens: hand-out order, ref counts, the LRU free queue and lazy eviction of cached blocks.

Every expected value below is worked out by hand from the rules in docs/ARCHITECTURE.md ("KV cache")."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm.engine.block_pool import BlockPool, hash_block_tokens


def free_ids(pool: BlockPool) -> list[int]:
    return list(pool.free_queue)


def refs(pool: BlockPool) -> list[int]:
    return [b.ref_cnt for b in pool.blocks]


# -- hand-out order and ref counts -------------------------------------------------------------------------------------


def test_blocks_are_handed_out_in_free_queue_order():
    pool = BlockPool(10, enable_caching=True)
    first = pool.get_new_blocks(3)
    second = pool.get_new_blocks(2)
    assert [b.block_id for b in first] == [0, 1, 2]
    assert [b.block_id for b in second] == [3, 4]
    assert pool.num_free_blocks == 5
    assert free_ids(pool) == [5, 6, 7, 8, 9]
    assert refs(pool) == [1, 1, 1, 1, 1, 0, 0, 0, 0, 0]
    assert pool.usage() == pytest.approx(0.5)


def test_freed_uncached_blocks_join_the_head_in_the_given_order():
    pool = BlockPool(6, enable_caching=False)
    blocks = pool.get_new_blocks(4)  # 0, 1, 2, 3
    pool.free_blocks([blocks[2], blocks[0], blocks[3]])
    assert free_ids(pool) == [2, 0, 3, 4, 5]
    assert refs(pool) == [0, 1, 0, 0, 0, 0]
    # the next blocks come from the head: the freed ones in the order they were freed, then the never-used ones
    assert [b.block_id for b in pool.get_new_blocks(4)] == [2, 0, 3, 4]
    assert free_ids(pool) == [5]
    # freed later: ahead of the blocks freed before
    pool.free_blocks([blocks[1]])
    assert free_ids(pool) == [1, 5]


def test_freed_cached_blocks_join_the_tail_behind_the_uncached():
    pool = BlockPool(6, enable_caching=True)
    blocks = pool.get_new_blocks(4)  # 0, 1, 2, 3
    pool.cache_block(blocks[1], b"a" * 32)
    pool.cache_block(blocks[3], b"b" * 32)
    pool.free_blocks([blocks[3], blocks[2], blocks[1], blocks[0]])
    # 2 and 0 hold nothing: the head, in the given order; 3 and 1 keep prefixes: the tail, in the given order
    assert free_ids(pool) == [2, 0, 4, 5, 3, 1]
    assert [b.block_id for b in pool.get_new_blocks(5)] == [2, 0, 4, 5, 3]
    assert pool.get_cached_block(b"b" * 32) is None  # 3 was taken: evicted
    assert pool.get_cached_block(b"a" * 32) is blocks[1]


def test_ref_counts_go_up_with_touch_and_down_with_free():
    pool = BlockPool(4, enable_caching=True)
    b0, b1 = pool.get_new_blocks(2)
    pool.touch([b0])  # a second user of block 0
    assert refs(pool) == [2, 1, 0, 0]
    pool.free_blocks([b0, b1])
    # block 0 still has one user, so only block 1 is free again (at the head: it holds no cached prefix)
    assert refs(pool) == [1, 0, 0, 0]
    assert free_ids(pool) == [1, 2, 3]
    pool.free_blocks([b0])
    assert refs(pool) == [0, 0, 0, 0]
    assert free_ids(pool) == [0, 1, 2, 3]


def test_freeing_a_block_twice_raises():
    pool = BlockPool(4, enable_caching=False)
    (b0,) = pool.get_new_blocks(1)
    pool.free_blocks([b0])
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free_blocks([b0])
    # the failed free changed nothing
    assert b0.ref_cnt == 0
    assert free_ids(pool) == [0, 1, 2, 3]


def test_freeing_a_never_allocated_block_raises():
    pool = BlockPool(4, enable_caching=False)
    with pytest.raises(RuntimeError):
        pool.free_blocks([pool.blocks[2]])
    assert free_ids(pool) == [0, 1, 2, 3]


def test_asking_for_more_blocks_than_free_raises_and_takes_nothing():
    pool = BlockPool(4, enable_caching=False)
    pool.get_new_blocks(3)
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(2)
    assert free_ids(pool) == [3]
    assert refs(pool) == [1, 1, 1, 0]


# -- prefix-cache hashes and lazy eviction -----------------------------------------------------------------------------


def test_cached_block_with_ref_zero_stays_findable_until_reused():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    hashes = [bytes([i]) * 32 for i in range(4)]
    for block, h in zip(blocks, hashes):
        pool.cache_block(block, h)
    pool.free_blocks([blocks[2], blocks[0], blocks[3], blocks[1]])
    assert free_ids(pool) == [2, 0, 3, 1]
    # ref 0, in the free queue, yet still found by hash
    for i, h in enumerate(hashes):
        assert pool.get_cached_block(h) is blocks[i]

    # handing a block out again evicts exactly that block, least recently freed first
    (taken,) = pool.get_new_blocks(1)
    assert taken.block_id == 2
    assert taken.block_hash is None
    assert pool.get_cached_block(hashes[2]) is None
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    assert pool.get_cached_block(hashes[3]) is blocks[3]
    assert pool.get_cached_block(hashes[1]) is blocks[1]

    # a cache hit on a free block pulls it out of the free queue, so it is not evicted next
    pool.touch([blocks[3]])
    assert blocks[3].ref_cnt == 1
    assert free_ids(pool) == [0, 1]
    taken = pool.get_new_blocks(2)
    assert [b.block_id for b in taken] == [0, 1]
    assert pool.get_cached_block(hashes[0]) is None
    assert pool.get_cached_block(hashes[1]) is None
    assert pool.get_cached_block(hashes[3]) is blocks[3]
    assert pool.cached == {hashes[3]: blocks[3]}


def test_cache_block_is_a_no_op_when_caching_is_disabled():
    pool = BlockPool(4, enable_caching=False)
    (b0,) = pool.get_new_blocks(1)
    pool.cache_block(b0, b"h" * 32)
    assert b0.block_hash is None
    assert pool.get_cached_block(b"h" * 32) is None


def test_duplicate_hash_keeps_the_first_block_and_evicting_the_copy_keeps_the_mapping():
    pool = BlockPool(4, enable_caching=True)
    b0, b1 = pool.get_new_blocks(2)
    h = b"x" * 32
    pool.cache_block(b0, h)
    pool.cache_block(b1, h)  # same content computed twice: the map keeps pointing at the first block
    assert pool.get_cached_block(h) is b0
    pool.free_blocks([b1, b0])
    assert free_ids(pool) == [2, 3, 1, 0]
    taken = pool.get_new_blocks(3)  # 2, 3, then 1: evicting the copy must not forget block 0
    assert [b.block_id for b in taken] == [2, 3, 1]
    assert pool.get_cached_block(h) is b0
    pool.get_new_blocks(1)  # now block 0 itself
    assert pool.get_cached_block(h) is None


def test_reset_prefix_cache_refuses_while_blocks_are_in_use():
    pool = BlockPool(4, enable_caching=True)
    b0, b1 = pool.get_new_blocks(2)
    h0, h1 = b"a" * 32, b"b" * 32
    pool.cache_block(b0, h0)
    pool.cache_block(b1, h1)
    pool.free_blocks([b0])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(h0) is b0
    assert pool.get_cached_block(h1) is b1
    pool.free_blocks([b1])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(h0) is None
    assert pool.get_cached_block(h1) is None
    assert b0.block_hash is None and b1.block_hash is None
    assert pool.num_free_blocks == 4
    # the queue was [2, 3, 0, 1] (0 and 1 freed to the tail, cached): now the most recently freed first
    assert free_ids(pool) == [1, 0, 3, 2]


# -- hash chains -------------------------------------------------------------------------------------------------------


def test_hash_is_stable_for_equal_inputs():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    b = hash_block_tokens(None, list(np.array([1, 2, 3, 4], dtype=np.int32)))
    assert isinstance(a, bytes) and len(a) == 32
    assert a == b
    salted_a = hash_block_tokens(a, [5, 6, 7, 8], ("salt",))
    salted_b = hash_block_tokens(bytes(b), [5, 6, 7, 8], ("salt",))
    assert salted_a == salted_b


def test_hash_changes_with_the_tokens_of_the_block():
    assert hash_block_tokens(None, [1, 2, 3, 4]) != hash_block_tokens(None, [1, 2, 3, 5])
    # order matters too
    assert hash_block_tokens(None, [1, 2, 3, 4]) != hash_block_tokens(None, [4, 3, 2, 1])


def test_hash_chains_on_the_parent_block():
    parent_a = hash_block_tokens(None, [1, 2, 3, 4])
    parent_b = hash_block_tokens(None, [1, 2, 3, 9])  # an earlier block differs in one token
    second_a = hash_block_tokens(parent_a, [5, 6, 7, 8])
    second_b = hash_block_tokens(parent_b, [5, 6, 7, 8])
    assert second_a != second_b
    # and the first block of a sequence differs from the same tokens placed after a parent
    assert hash_block_tokens(None, [5, 6, 7, 8]) != second_a


def test_hash_changes_with_extra_keys():
    tokens = [1, 2, 3, 4]
    plain = hash_block_tokens(None, tokens)
    salt_a = hash_block_tokens(None, tokens, ("a",))
    salt_b = hash_block_tokens(None, tokens, ("b",))
    assert len({plain, salt_a, salt_b}) == 3
    # the salt of the first block reaches every later block through the chain
    assert hash_block_tokens(salt_a, [5, 6, 7, 8]) != hash_block_tokens(plain, [5, 6, 7, 8])
