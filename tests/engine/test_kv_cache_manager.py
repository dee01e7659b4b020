"""KVCacheManager: slot allocation, freeing order, prefix-cache lookups and shared prefixes (block_size 4).

Expected block ids and hashes are worked out by hand from the rules in docs/ARCHITECTURE.md ("KV cache")."""

from __future__ import annotations

from pagedllm.engine.block_pool import hash_block_tokens
from pagedllm.engine.kv_cache_manager import KVCacheManager
from pagedllm.engine.request import Request
from pagedllm.sampling_params import SamplingParams

BS = 4


def make_request(req_id: str, tokens: list[int], cache_salt: str | None = None, **params) -> Request:
    sp = SamplingParams(max_tokens=8, ignore_eos=True, **params)
    return Request(req_id, list(tokens), sp, eos_token_id=None, max_tokens=8, cache_salt=cache_salt)


def free_ids(kv: KVCacheManager) -> list[int]:
    return list(kv.pool.free_queue)


def refs(kv: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in kv.pool.blocks]


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def compute(kv: KVCacheManager, req: Request, num_tokens: int | None = None) -> list[int]:
    """Allocates and 'computes' num_tokens more tokens of req (all remaining by default), with any prefix hit."""
    hit_blocks, num_hit = kv.get_computed_blocks(req) if req.num_computed_tokens == 0 else ([], 0)
    n = req.num_tokens - req.num_computed_tokens - num_hit if num_tokens is None else num_tokens
    new = kv.allocate_slots(req, n, hit_blocks)
    assert new is not None
    req.num_computed_tokens += num_hit + n
    return ids(new)


PROMPT12 = list(range(100, 112))  # three full blocks


# -- allocation --------------------------------------------------------------------------------------------------------


def test_allocate_slots_gives_cdiv_blocks_in_free_queue_order():
    kv = KVCacheManager(10, BS, enable_caching=False)
    a = make_request("a", range(10))
    assert ids(kv.allocate_slots(a, 10)) == [0, 1, 2]  # cdiv(10, 4) = 3
    a.num_computed_tokens = 10
    assert ids(kv.allocate_slots(a, 2)) == []  # 12 tokens still fit in 3 blocks
    a.num_computed_tokens = 12
    assert ids(kv.allocate_slots(a, 1)) == [3]  # the 13th token opens block 4
    b = make_request("b", range(5))
    assert ids(kv.allocate_slots(b, 5)) == [4, 5]
    assert kv.block_ids("a") == [0, 1, 2, 3]
    assert kv.block_ids("b") == [4, 5]
    assert kv.pool.num_free_blocks == 4
    assert refs(kv) == [1] * 6 + [0] * 4


def test_allocate_slots_for_a_chunk_of_the_prompt():
    kv = KVCacheManager(10, BS, enable_caching=True)
    a = make_request("a", range(19))
    blocks = kv.pool.blocks
    assert ids(kv.allocate_slots(a, 6)) == [0, 1]  # cdiv(6, 4)
    # only block 0 is full of computed tokens after this chunk; block 1 holds 2 of its 4 and must not be a hit yet
    assert blocks[0].block_hash is not None
    assert blocks[1].block_hash is None
    assert kv.get_computed_blocks(make_request("b", range(19)))[1] == 4
    a.num_computed_tokens = 6
    assert ids(kv.allocate_slots(a, 6)) == [2]  # cdiv(12, 4) = 3 in all
    assert [b.block_hash is not None for b in blocks[:3]] == [True, True, True]
    a.num_computed_tokens = 12
    assert ids(kv.allocate_slots(a, 7)) == [3, 4]  # cdiv(19, 4) = 5 in all
    assert [b.block_hash is not None for b in blocks[:5]] == [True, True, True, True, False]


def test_allocate_slots_returns_none_and_changes_nothing_when_short():
    kv = KVCacheManager(4, BS, enable_caching=True)
    a = make_request("a", range(12))
    assert ids(kv.allocate_slots(a, 12)) == [0, 1, 2]
    b = make_request("b", range(50, 58))  # needs 2 blocks, 1 free
    assert kv.allocate_slots(b, 8) is None
    assert kv.block_ids("b") == []
    assert kv.pool.num_free_blocks == 1
    assert free_ids(kv) == [3]
    assert refs(kv) == [1, 1, 1, 0]
    # a request that fits still gets the last block
    c = make_request("c", range(60, 63))
    assert ids(kv.allocate_slots(c, 3)) == [3]


def test_free_returns_blocks_tail_first():
    kv = KVCacheManager(10, BS, enable_caching=False)
    a = make_request("a", range(10))
    b = make_request("b", range(20, 25))
    kv.allocate_slots(a, 10)  # 0, 1, 2
    kv.allocate_slots(b, 5)  # 3, 4
    kv.free(a)  # no caching: nothing cached, so the freed blocks go to the head of the queue (tail block first)
    assert free_ids(kv) == [2, 1, 0, 5, 6, 7, 8, 9]
    kv.free(b)
    assert free_ids(kv) == [4, 3, 2, 1, 0, 5, 6, 7, 8, 9]
    assert refs(kv) == [0] * 10
    assert kv.block_ids("a") == []
    # freeing a request that owns nothing (again) frees no block twice
    kv.free(a)
    assert free_ids(kv) == [4, 3, 2, 1, 0, 5, 6, 7, 8, 9]


def test_full_blocks_get_chained_hashes_and_the_partial_one_none():
    kv = KVCacheManager(10, BS, enable_caching=True)
    tokens = list(range(30, 40))  # 10 tokens: 2 full blocks + 2 tokens
    a = make_request("a", tokens)
    kv.allocate_slots(a, 10)
    h0 = hash_block_tokens(None, tokens[0:4])
    h1 = hash_block_tokens(h0, tokens[4:8])
    blocks = kv.pool.blocks
    assert blocks[0].block_hash == h0
    assert blocks[1].block_hash == h1
    assert blocks[2].block_hash is None
    assert kv.pool.cached == {h0: blocks[0], h1: blocks[1]}
    # the third block is registered once a decode step fills it
    a.num_computed_tokens = 10
    a.append_output_token(40)  # 11 tokens: block 2 is still partial after this decode step
    assert ids(kv.allocate_slots(a, 1)) == []
    assert blocks[2].block_hash is None
    a.num_computed_tokens = 11
    a.append_output_token(41)  # 12 tokens: this decode step fills block 2
    assert ids(kv.allocate_slots(a, 1)) == []
    assert blocks[2].block_hash == hash_block_tokens(h1, [38, 39, 40, 41])


# -- prefix-cache lookups ----------------------------------------------------------------------------------------------


def cached_manager() -> KVCacheManager:
    """A manager whose request "a" (PROMPT12, three full blocks 0, 1, 2) was computed and then freed."""
    kv = KVCacheManager(10, BS, enable_caching=True)
    a = make_request("a", PROMPT12)
    assert compute(kv, a) == [0, 1, 2]
    kv.free(a)
    assert free_ids(kv) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    return kv


def test_get_computed_blocks_finds_the_longest_cached_prefix():
    kv = cached_manager()
    b = make_request("b", PROMPT12[:8] + [7, 7, 7, 7])  # shares two blocks, then differs
    blocks, num = kv.get_computed_blocks(b)
    assert ids(blocks) == [0, 1]
    assert num == 8


def test_get_computed_blocks_never_covers_the_last_prompt_token():
    kv = cached_manager()
    # exactly two full cached blocks: the last token must be recomputed, so only one block is a hit
    blocks, num = kv.get_computed_blocks(make_request("b", PROMPT12[:8]))
    assert ids(blocks) == [0]
    assert num == 4
    # the very same 12-token prompt: all three blocks are cached, two are used
    blocks, num = kv.get_computed_blocks(make_request("c", PROMPT12))
    assert ids(blocks) == [0, 1]
    assert num == 8
    # one more token: now all three cached blocks count
    blocks, num = kv.get_computed_blocks(make_request("d", PROMPT12 + [5]))
    assert ids(blocks) == [0, 1, 2]
    assert num == 12


def test_get_computed_blocks_stops_at_the_first_differing_block():
    kv = cached_manager()
    first_differs = [999] + PROMPT12[1:] + [5]
    assert kv.get_computed_blocks(make_request("b", first_differs)) == ([], 0)
    # the second block differs: the third is not a hit either although its own tokens are equal (parent chain)
    second_differs = PROMPT12[:5] + [999] + PROMPT12[6:] + [5]
    blocks, num = kv.get_computed_blocks(make_request("c", second_differs))
    assert ids(blocks) == [0]
    assert num == 4


def test_get_computed_blocks_respects_cache_salt():
    kv = cached_manager()  # "a" had no salt
    assert kv.get_computed_blocks(make_request("b", PROMPT12 + [5], cache_salt="tenant-1")) == ([], 0)
    s1 = make_request("s1", PROMPT12, cache_salt="tenant-1")
    assert compute(kv, s1) == [3, 4, 5]
    kv.free(s1)
    blocks, num = kv.get_computed_blocks(make_request("s2", PROMPT12 + [5], cache_salt="tenant-1"))
    assert ids(blocks) == [3, 4, 5]
    assert num == 12
    assert kv.get_computed_blocks(make_request("s3", PROMPT12 + [5], cache_salt="tenant-2")) == ([], 0)
    blocks, num = kv.get_computed_blocks(make_request("plain", PROMPT12 + [5]))
    assert ids(blocks) == [0, 1, 2]


def test_get_computed_blocks_skips_when_caching_is_disabled():
    kv = KVCacheManager(10, BS, enable_caching=False)
    a = make_request("a", PROMPT12)
    assert compute(kv, a) == [0, 1, 2]
    kv.free(a)
    assert all(b.block_hash is None for b in kv.pool.blocks)
    assert kv.get_computed_blocks(make_request("b", PROMPT12 + [5])) == ([], 0)


def test_get_computed_blocks_skips_when_prompt_logprobs_are_asked():
    kv = cached_manager()
    req = make_request("b", PROMPT12 + [5])
    req.sampling_params.prompt_logprobs = 0  # logprobs of every prompt token need every prompt row computed
    assert req.needs_prompt_logprobs
    assert kv.get_computed_blocks(req) == ([], 0)


def test_a_cached_block_is_lost_once_the_pool_hands_it_out_again():
    kv = cached_manager()  # free queue [3..9, 2, 1, 0]
    filler = make_request("f", range(500, 528))  # 7 blocks: 3..9
    assert compute(kv, filler) == [3, 4, 5, 6, 7, 8, 9]
    other = make_request("o", range(600, 604))  # 1 block: evicts block 2, the tail of the cached prefix
    assert compute(kv, other) == [2]
    blocks, num = kv.get_computed_blocks(make_request("b", PROMPT12 + [5]))
    assert ids(blocks) == [0, 1]
    assert num == 8


# -- shared prefixes ---------------------------------------------------------------------------------------------------


def test_two_requests_share_a_prefix_with_ref_counts():
    kv = KVCacheManager(10, BS, enable_caching=True)
    a = make_request("a", PROMPT12)
    assert compute(kv, a) == [0, 1, 2]
    b = make_request("b", PROMPT12[:8] + [1, 2, 3, 4, 5])  # 13 tokens, shares blocks 0 and 1
    hit, num = kv.get_computed_blocks(b)
    assert (ids(hit), num) == ([0, 1], 8)
    new = kv.allocate_slots(b, 5, hit)  # cdiv(13, 4) = 4 blocks: 2 shared + 2 new
    assert ids(new) == [3, 4]
    assert kv.block_ids("b") == [0, 1, 3, 4]
    assert refs(kv)[:6] == [2, 2, 1, 1, 1, 0]
    assert kv.pool.num_free_blocks == 5

    kv.free(a)
    assert refs(kv)[:6] == [1, 1, 0, 1, 1, 0]
    assert free_ids(kv) == [5, 6, 7, 8, 9, 2]
    kv.free(b)  # tail first: 4 (partial, never cached) to the head; 3 (b's own full block), 1 and 0 to the tail
    assert refs(kv) == [0] * 10
    assert free_ids(kv) == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]


def test_hit_on_free_cached_blocks_counts_them_as_not_free():
    # 5 blocks; "a" (3 full blocks) computed and freed: free queue [3, 4, 2, 1, 0], blocks 0-2 cached.
    kv = KVCacheManager(5, BS, enable_caching=True)
    a = make_request("a", PROMPT12)
    compute(kv, a)
    kv.free(a)
    assert free_ids(kv) == [3, 4, 2, 1, 0]
    # 21 tokens: 3 blocks hit, cdiv(21, 4) = 6 needed, 3 new, but only 2 free blocks are not the hit blocks
    big = make_request("big", PROMPT12 + list(range(9)))
    hit, num = kv.get_computed_blocks(big)
    assert (ids(hit), num) == ([0, 1, 2], 12)
    assert kv.allocate_slots(big, 9, hit) is None
    assert free_ids(kv) == [3, 4, 2, 1, 0]
    assert refs(kv) == [0] * 5
    assert kv.pool.get_cached_block(kv.pool.blocks[2].block_hash) is kv.pool.blocks[2]
    # 17 tokens: cdiv(17, 4) = 5 needed, 2 new: fits exactly, and the new blocks are not the hit ones
    ok = make_request("ok", PROMPT12 + list(range(5)))
    hit, num = kv.get_computed_blocks(ok)
    assert ids(kv.allocate_slots(ok, 5, hit)) == [3, 4]
    assert kv.block_ids("ok") == [0, 1, 2, 3, 4]
    assert refs(kv) == [1] * 5


def test_hit_statistics_count_recorded_lookups_only():
    kv = cached_manager()
    queries, hits = kv.num_queries, kv.num_hits
    b = make_request("b", PROMPT12 + [5])
    _, num = kv.get_computed_blocks(b)
    _, num = kv.get_computed_blocks(b)  # a retried lookup of a request that did not fit yet counts nothing
    assert (kv.num_queries, kv.num_hits) == (queries, hits)
    kv.record_lookup(b, num)  # admitted: 13 tokens asked, 12 found
    kv.record_lookup(make_request("c", [1, 2, 3, 4, 5]), 0)
    assert (kv.num_queries - queries, kv.num_hits - hits) == (13 + 5, 12)
    kv.record_lookup(make_request("d", PROMPT12, prompt_logprobs=1), 0)  # skips the cache: not a lookup
    assert kv.num_queries - queries == 18


def test_decode_steps_cache_each_block_as_it_fills():
    """Decode steps, one token each, through several block boundaries (most steps need no new block and fill none:
    allocate_slots' fast path): a block joins the prefix cache, under its chained hash, the step its last token is
    computed, never earlier; new blocks come exactly at the boundaries."""
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=True)
    req = make_request("a", [5, 6, 7, 8, 9, 10])
    req.max_tokens = req.sampling_params.max_tokens = 20
    compute(kv, req)  # the prompt: 6 tokens, one full block
    for step in range(11):
        req.append_output_token(100 + step)  # sampled, computed by the next step
        owned_before = len(kv.req_to_blocks["a"])
        new = kv.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        assert len(new) == (1 if req.num_computed_tokens % BS == 1 else 0), step
        assert len(kv.req_to_blocks["a"]) == owned_before + len(new)
        full = req.num_computed_tokens // BS
        assert kv.num_cached_blocks["a"] == full, step
        parent, tokens = None, req.all_token_ids
        for i, block in enumerate(kv.req_to_blocks["a"]):
            expected = hash_block_tokens(parent, tokens[i * BS : (i + 1) * BS]) if i < full else None
            assert block.block_hash == expected, (step, i)
            if expected is not None:
                assert kv.pool.get_cached_block(expected) is block
            parent = expected
