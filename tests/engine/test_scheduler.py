"""Scheduler: token budget, chunked prefill, max_num_seqs, preemption, admission checks, finishing and prefix hits.

Tiny configs (block_size 4, about 10 blocks). Every expected schedule is traced by hand from docs/ARCHITECTURE.md
("The scheduling rule"); the comments show the trace."""

from __future__ import annotations

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.scheduler_output import ModelRunnerOutput, SchedulerOutput

BS = 4


def make_scheduler(num_blocks: int = 10, budget: int = 32, max_num_seqs: int = 8, caching: bool = False) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget),
        CacheConfig(block_size=BS, enable_prefix_caching=caching),
        num_blocks,
    )


def make_request(req_id: str, prompt: list[int] | range, max_tokens: int, cache_salt: str | None = None) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(req_id, list(prompt), sp, eos_token_id=0, max_tokens=max_tokens, cache_salt=cache_salt)


def sample(sched: Scheduler, so: SchedulerOutput, token: int = 7):
    """The model runner's answer: one token for each scheduled request that reached the end of its known tokens."""
    sampled = {}
    for req_id in so.num_scheduled_tokens:
        req = sched.requests[req_id]
        if req.num_computed_tokens == req.num_tokens:
            sampled[req_id] = [token]
    return sched.update_from_output(so, ModelRunnerOutput(sampled_token_ids=sampled))


def step(sched: Scheduler, token: int = 7) -> SchedulerOutput:
    so = sched.schedule()
    sample(sched, so, token)
    return so


def new_ids(so: SchedulerOutput) -> dict[str, list[int]]:
    return {r.req_id: r.block_ids for r in so.new_reqs}


def cached_ids(so: SchedulerOutput) -> dict[str, list[int]]:
    return {r.req_id: r.new_block_ids for r in so.cached_reqs}


def free_ids(sched: Scheduler) -> list[int]:
    return list(sched.kv.pool.free_queue)


# -- the token budget --------------------------------------------------------------------------------------------------


def test_chunked_prefill_and_running_requests_first():
    sched = make_scheduler(budget=8)
    a = make_request("a", range(100, 119), max_tokens=4)  # 19 prompt tokens
    sched.add_request(a)

    so = step(sched)  # a: 8 of 19
    assert so.num_scheduled_tokens == {"a": 8}
    assert so.total_num_scheduled_tokens == 8
    assert new_ids(so) == {"a": [0, 1]}
    assert so.new_reqs[0].num_computed_tokens == 0
    assert so.new_reqs[0].token_ids == list(range(100, 119))
    assert so.new_reqs[0].num_prompt_tokens == 19
    assert so.cached_reqs == []
    assert (a.num_computed_tokens, a.num_output_tokens) == (8, 0)

    b = make_request("b", range(200, 205), max_tokens=4)  # 5 prompt tokens
    sched.add_request(b)
    so = step(sched)  # a (running) takes the whole budget: 8 more; b gets nothing
    assert so.num_scheduled_tokens == {"a": 8}
    assert so.new_reqs == []
    assert cached_ids(so) == {"a": [2, 3]}
    assert so.cached_reqs[0].num_computed_tokens == 8
    assert list(sched.waiting) == [b]

    so = step(sched)  # a: last 3 prompt tokens (samples its 1st token); b: min(5, 8 - 3) = 5
    assert so.num_scheduled_tokens == {"a": 3, "b": 5}
    assert list(so.num_scheduled_tokens) == ["a", "b"]  # batch order: running first
    assert cached_ids(so) == {"a": [4]}
    assert so.cached_reqs[0].num_computed_tokens == 16
    assert new_ids(so) == {"b": [5, 6]}
    assert (a.num_output_tokens, b.num_output_tokens) == (1, 1)

    so = step(sched)  # both decode: 1 token each; a at 20 tokens still fits 5 blocks, b at 6 fits 2
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}
    assert cached_ids(so) == {"a": [], "b": []}
    assert {r.req_id: r.num_computed_tokens for r in so.cached_reqs} == {"a": 19, "b": 5}


def test_waiting_requests_get_min_of_their_tokens_and_the_budget_left():
    sched = make_scheduler(budget=10)
    a = make_request("a", range(6), max_tokens=2)
    b = make_request("b", range(10, 16), max_tokens=2)
    c = make_request("c", range(20, 23), max_tokens=2)
    for r in (a, b, c):
        sched.add_request(r)
    so = step(sched)  # a: 6, b: min(6, 4) = 4, budget spent, c waits
    assert so.num_scheduled_tokens == {"a": 6, "b": 4}
    assert new_ids(so) == {"a": [0, 1], "b": [2]}
    assert [r.request_id for r in sched.waiting] == ["c"]
    so = step(sched)  # a: decode 1; b: its last 2; c: min(3, 10 - 3) = 3
    assert so.num_scheduled_tokens == {"a": 1, "b": 2, "c": 3}
    assert cached_ids(so) == {"a": [], "b": [3]}
    assert new_ids(so) == {"c": [4]}


def test_max_num_seqs_is_respected():
    sched = make_scheduler(budget=64, max_num_seqs=2)
    reqs = [make_request(x, range(10 * i, 10 * i + 4), max_tokens=2) for i, x in enumerate("abc")]
    for r in reqs:
        sched.add_request(r)
    so = step(sched)  # only two sequences run; the budget would allow all three
    assert so.num_scheduled_tokens == {"a": 4, "b": 4}
    assert new_ids(so) == {"a": [0], "b": [1]}
    assert [r.request_id for r in sched.waiting] == ["c"]
    so = step(sched)  # a and b decode their 2nd and last token (5 tokens: a second block each); c still waits
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}
    assert cached_ids(so) == {"a": [2], "b": [3]}
    assert [r.request_id for r in sched.waiting] == ["c"]
    assert [r.request_id for r in sched.running] == []
    so = step(sched)  # a freed [2, 0], then b [3, 1], to the head (nothing cached); c gets the head: 3
    assert so.finished_req_ids == {"a", "b"}
    assert so.num_scheduled_tokens == {"c": 4}
    assert new_ids(so) == {"c": [3]}


# -- admission ---------------------------------------------------------------------------------------------------------


def test_a_request_that_can_never_fit_is_rejected_at_add_request():
    sched = make_scheduler(num_blocks=10)  # 40 slots
    # the last sampled token is never fed back, so prompt + max_tokens - 1 slots are needed: 30 + 12 - 1 = 41
    with pytest.raises(ValueError, match="max_tokens"):
        sched.add_request(make_request("big", range(30), max_tokens=12))
    assert "big" not in sched.requests
    assert not sched.has_unfinished_requests()
    with pytest.raises(ValueError):
        sched.add_request(make_request("huge", range(41), max_tokens=1))
    # 30 + 11 - 1 = 40 slots: exactly the whole cache, accepted
    sched.add_request(make_request("fits", range(30), max_tokens=11))
    assert [r.request_id for r in sched.waiting] == ["fits"]


def test_a_request_that_exactly_fits_the_whole_cache_runs_to_the_end():
    sched = make_scheduler(num_blocks=10, budget=16)
    r = make_request("fits", range(30), max_tokens=11)
    sched.add_request(r)
    steps = []
    while sched.has_unfinished_requests():
        steps.append(step(sched).num_scheduled_tokens["fits"])
        assert len(steps) <= 12
    # prefill 16 + 14 (the 1st token), then 10 decode steps; the last one uses the 10th block
    assert steps == [16, 14] + [1] * 10
    assert r.status == RequestStatus.FINISHED_LENGTH
    assert r.num_output_tokens == 11
    assert sched.kv.pool.num_free_blocks == 10


def test_duplicate_request_id_is_rejected():
    sched = make_scheduler()
    sched.add_request(make_request("a", range(4), max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("a", range(8), max_tokens=2))
    assert len(sched.waiting) == 1
    assert sched.requests["a"].num_prompt_tokens == 4


# -- finishing ---------------------------------------------------------------------------------------------------------


def test_finish_by_max_tokens_frees_the_blocks():
    sched = make_scheduler(num_blocks=10)
    a = make_request("a", [5, 6, 7, 8], max_tokens=2)
    sched.add_request(a)
    so = sched.schedule()
    assert new_ids(so) == {"a": [0]}
    outs = sample(sched, so, token=11)
    assert [(o.req_id, o.new_token_ids, o.finish_reason) for o in outs] == [("a", [11], None)]
    so = sched.schedule()  # 5 tokens: a second block
    assert cached_ids(so) == {"a": [1]}
    outs = sample(sched, so, token=12)
    assert [(o.req_id, o.new_token_ids, o.finish_reason) for o in outs] == [("a", [12], "length")]
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert a.output_token_ids == [11, 12]
    assert sched.kv.block_ids("a") == []
    assert free_ids(sched) == [1, 0, 2, 3, 4, 5, 6, 7, 8, 9]  # tail first, to the head (no caching)
    assert [b.ref_cnt for b in sched.kv.pool.blocks] == [0] * 10
    assert not sched.has_unfinished_requests()
    assert "a" not in sched.requests
    so = sched.schedule()
    assert so.finished_req_ids == {"a"}
    assert so.num_scheduled_tokens == {}


def test_finish_requests_aborts_running_and_waiting_requests():
    sched = make_scheduler(num_blocks=10, max_num_seqs=1)
    a = make_request("a", range(10), max_tokens=5)
    b = make_request("b", range(20, 26), max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    so = step(sched)
    assert new_ids(so) == {"a": [0, 1, 2]}
    assert [r.request_id for r in sched.waiting] == ["b"]

    sched.finish_requests(["a", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert sched.running == []
    assert "a" not in sched.requests
    assert sched.kv.block_ids("a") == []
    assert free_ids(sched) == [2, 1, 0, 3, 4, 5, 6, 7, 8, 9]
    # a late token for the aborted request is ignored
    assert sched.update_from_output(so, ModelRunnerOutput(sampled_token_ids={"a": [3]})) == []
    assert a.num_output_tokens == 1

    so = sched.schedule()  # b takes the freed seat and a's blocks from the head
    assert so.finished_req_ids == {"a"}
    assert new_ids(so) == {"b": [2, 1]}

    c = make_request("c", range(30, 34), max_tokens=5)
    sched.add_request(c)
    sched.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    assert list(sched.waiting) == []
    assert c.status == RequestStatus.FINISHED_ABORTED
    assert [r.request_id for r in sched.running] == ["b"]
    assert sched.kv.pool.num_free_blocks == 8


# -- preemption --------------------------------------------------------------------------------------------------------


def run_until_preemption(
    caching: bool, waiting_behind: Request | None = None
) -> tuple[Scheduler, Request, Request, SchedulerOutput]:
    """a and b: 16-token prompts (4 blocks each), 10 blocks. Both prefill in step 1 (a: 0-3, b: 4-7), both take a 5th
    block in step 2 (a: 8, b: 9), then decode until 20 tokens each. In step 6 a needs a 6th block and none is free:
    b, the newest running request, is preempted and a gets b's last block (9, the head of b's tail-first free)."""
    sched = make_scheduler(num_blocks=10, budget=32, caching=caching)
    a = make_request("a", range(100, 116), max_tokens=10)
    b = make_request("b", range(200, 216), max_tokens=10)
    sched.add_request(a)
    sched.add_request(b)
    so = step(sched)
    assert new_ids(so) == {"a": [0, 1, 2, 3], "b": [4, 5, 6, 7]}
    so = step(sched)
    assert cached_ids(so) == {"a": [8], "b": [9]}
    if waiting_behind is not None:
        sched.add_request(waiting_behind)  # no block is free: it waits
    for _ in range(3):
        so = step(sched)
        assert so.num_scheduled_tokens == {"a": 1, "b": 1}
        assert cached_ids(so) == {"a": [], "b": []}
    assert (a.num_tokens, b.num_tokens) == (21, 21)
    assert sched.kv.pool.num_free_blocks == 0

    so = step(sched)
    assert so.preempted_req_ids == {"b"}
    assert so.num_scheduled_tokens == {"a": 1}
    assert cached_ids(so) == {"a": [9]}
    assert so.cached_reqs[0].num_computed_tokens == 20
    assert so.new_reqs == []
    assert so.cached_reqs[0].req_id == "a"
    return sched, a, b, so


@pytest.mark.parametrize("caching", [False, True])
def test_preemption_takes_the_newest_request_and_resumes_it(caching):
    sched, a, b, so_preempt = run_until_preemption(caching)
    assert b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and sched.num_preemptions == 1
    assert b.num_tokens == 21  # its 5 generated tokens are kept and recomputed
    assert sched.kv.block_ids("b") == []
    assert [r.request_id for r in sched.running] == ["a"]
    assert list(sched.waiting)[0] is b
    assert free_ids(sched) == [7, 6, 5, 4]
    # a stale token for the preempted request changes nothing
    assert sched.update_from_output(so_preempt, ModelRunnerOutput(sampled_token_ids={"b": [9]})) == []
    assert b.num_tokens == 21
    assert b.status == RequestStatus.PREEMPTED

    # steps 7-10: a decodes alone (step 10 opens its 7th block, 7) and finishes; b does not fit
    for i in range(4):
        so = step(sched)
        assert so.num_scheduled_tokens == {"a": 1}
        assert cached_ids(so) == {"a": [7] if i == 3 else []}
    assert a.status == RequestStatus.FINISHED_LENGTH
    # a freed [0, 1, 2, 3, 8, 9, 7] tail first: without caching all of them to the head, before [6, 5, 4]; with
    # caching only 7 (tokens 24-25, not full), the full blocks to the tail behind b's cached [6, 5, 4]
    if caching:
        assert free_ids(sched) == [7, 6, 5, 4, 9, 8, 3, 2, 1, 0]
    else:
        assert free_ids(sched) == [7, 9, 8, 3, 2, 1, 0, 6, 5, 4]

    # step 11: b comes back as a new request with all 21 of its tokens
    so = step(sched)
    assert so.finished_req_ids == {"a"}
    (nb,) = so.new_reqs
    assert nb.req_id == "b"
    assert nb.token_ids == list(range(200, 216)) + [7] * 5
    assert nb.num_prompt_tokens == 16
    if caching:
        # b's own first three blocks were still cached (4, 5, 6); block 7 (its 4th) and 9 (its 5th) went to a
        assert nb.num_computed_tokens == 12
        assert nb.block_ids == [4, 5, 6, 7, 9, 8]
        assert so.num_scheduled_tokens == {"b": 9}
    else:
        assert nb.num_computed_tokens == 0
        assert nb.block_ids == [7, 9, 8, 3, 2, 1]
        assert so.num_scheduled_tokens == {"b": 21}
    assert b.status == RequestStatus.RUNNING
    assert b.num_output_tokens == 6
    assert b.num_cached_tokens == 0  # the prefix hit of its first admission, not of the resumption

    # steps 12-15: b decodes to its 10th token; step 15 opens its 7th block, the head of the queue (caching: 3 of
    # [3, 2, 1, 0]; without: 0 of [0, 6, 5, 4])
    seventh = 3 if caching else 0
    for i in range(4):
        so = step(sched)
        assert so.num_scheduled_tokens == {"b": 1}
        assert cached_ids(so) == {"b": [seventh] if i == 3 else []}
    assert b.status == RequestStatus.FINISHED_LENGTH
    assert b.num_output_tokens == 10
    assert not sched.has_unfinished_requests()
    assert sched.kv.pool.num_free_blocks == 10
    assert [blk.ref_cnt for blk in sched.kv.pool.blocks] == [0] * 10


def test_the_request_that_needs_a_block_preempts_itself_when_it_is_the_newest():
    # 8 blocks. a: 14 tokens (0-3, two spare slots), b: 16 tokens (4-7, full).
    sched = make_scheduler(num_blocks=8, budget=32)
    a = make_request("a", range(100, 114), max_tokens=3)
    b = make_request("b", range(200, 216), max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    so = step(sched)
    assert new_ids(so) == {"a": [0, 1, 2, 3], "b": [4, 5, 6, 7]}
    # step 2: a's 15th token fits; b's 17th needs a 5th block; b is the newest, so b itself is preempted
    so = step(sched)
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.preempted_req_ids == {"b"}
    assert b.status == RequestStatus.PREEMPTED
    assert a.status == RequestStatus.RUNNING
    assert free_ids(sched) == [7, 6, 5, 4]
    # step 3: a finishes (3rd token, 16 tokens fit 4 blocks); b (17 tokens, 5 blocks) still does not fit
    so = step(sched)
    assert so.num_scheduled_tokens == {"a": 1}
    assert a.status == RequestStatus.FINISHED_LENGTH
    # step 4: b recomputes all 17 tokens, in a's freed blocks [3, 2, 1, 0] (the head), then its own 7
    so = step(sched)
    assert so.num_scheduled_tokens == {"b": 17}
    assert new_ids(so) == {"b": [3, 2, 1, 0, 7]}
    while sched.has_unfinished_requests():
        step(sched)
    assert b.num_output_tokens == 4
    assert sched.kv.pool.num_free_blocks == 8


def test_a_preempted_request_goes_to_the_front_of_the_waiting_queue():
    c = make_request("c", range(300, 304), max_tokens=1)  # arrives after step 2, when no block is free
    sched, a, b, so = run_until_preemption(caching=False, waiting_behind=c)
    # the step that preempted b admitted nothing, although 4 blocks were free after it and c needs 1
    assert so.new_reqs == []
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    so = step(
        sched
    )  # b is at the head and does not fit (6 blocks, 4 free): c waits behind it (first come first served)
    assert so.num_scheduled_tokens == {"a": 1}
    assert [r.request_id for r in sched.waiting] == ["b", "c"]


# -- prefix caching ----------------------------------------------------------------------------------------------------


PROMPT10 = list(range(50, 60))  # 2 full blocks + 2 tokens


def test_a_prefix_cache_hit_starts_with_computed_tokens_and_shares_blocks():
    sched = make_scheduler(num_blocks=10, caching=True)
    a = make_request("a", PROMPT10, max_tokens=5)
    sched.add_request(a)
    so = step(sched)
    assert new_ids(so) == {"a": [0, 1, 2]}
    assert so.new_reqs[0].num_computed_tokens == 0

    b = make_request("b", PROMPT10, max_tokens=5)
    sched.add_request(b)
    so = sched.schedule()
    # a decodes; b hits a's 2 full blocks (8 tokens) and computes its last 2 prompt tokens in a new block
    assert so.num_scheduled_tokens == {"a": 1, "b": 2}
    (nb,) = so.new_reqs
    assert nb.num_computed_tokens == 8
    assert nb.block_ids == [0, 1, 3]
    assert sched.kv.block_ids("a") == [0, 1, 2]
    assert [blk.ref_cnt for blk in sched.kv.pool.blocks[:4]] == [2, 2, 1, 1]
    outs = sample(sched, so)
    assert {o.req_id: o.num_cached_tokens for o in outs} == {"a": 0, "b": 8}
    assert b.num_cached_tokens == 8
    assert b.num_computed_tokens == 10

    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert [blk.ref_cnt for blk in sched.kv.pool.blocks[:4]] == [1, 1, 0, 1]
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert [blk.ref_cnt for blk in sched.kv.pool.blocks] == [0] * 10
    assert sched.kv.pool.num_free_blocks == 10


def test_a_prefix_cache_hit_after_the_first_request_finished():
    sched = make_scheduler(num_blocks=10, caching=True)
    a = make_request("a", PROMPT10, max_tokens=1)
    sched.add_request(a)
    step(sched)
    assert a.status == RequestStatus.FINISHED_LENGTH
    # a's full blocks 0 and 1 cached, at the tail; 2 (two tokens) to the head
    assert free_ids(sched) == [2, 3, 4, 5, 6, 7, 8, 9, 1, 0]
    b = make_request("b", PROMPT10, max_tokens=1)
    sched.add_request(b)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"b": 2}
    assert new_ids(so) == {"b": [0, 1, 2]}
    assert so.new_reqs[0].num_computed_tokens == 8


def test_prefix_cache_counters_count_each_admission_once():
    sched = make_scheduler(num_blocks=6, caching=True)
    a = make_request("a", range(200, 216), max_tokens=4)  # 16 tokens: 4 blocks now, a 5th to decode
    sched.add_request(a)
    step(sched)
    assert (sched.kv.num_queries, sched.kv.num_hits) == (16, 0)
    b = make_request("b", PROMPT10, max_tokens=2)  # needs 3 blocks, only 1 or 2 are free while a runs
    sched.add_request(b)
    for _ in range(3):  # b is looked up at the head of the queue every step, but not admitted
        so = step(sched)
        assert "b" not in so.num_scheduled_tokens
    assert (sched.kv.num_queries, sched.kv.num_hits) == (16, 0)
    while a.status == RequestStatus.RUNNING:
        step(sched)
    so = step(sched)
    assert so.num_scheduled_tokens == {"b": 10}
    assert (sched.kv.num_queries, sched.kv.num_hits) == (16 + 10, 0)


def test_no_prefix_hit_across_cache_salts_or_without_caching():
    sched = make_scheduler(num_blocks=10, caching=True)
    sched.add_request(make_request("a", PROMPT10, max_tokens=1, cache_salt="x"))
    step(sched)
    sched.add_request(make_request("b", PROMPT10, max_tokens=1, cache_salt="y"))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"b": 10}
    assert so.new_reqs[0].num_computed_tokens == 0

    sched = make_scheduler(num_blocks=10, caching=False)
    sched.add_request(make_request("a", PROMPT10, max_tokens=1))
    step(sched)
    sched.add_request(make_request("b", PROMPT10, max_tokens=1))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"b": 10}
    assert new_ids(so) == {"b": [2, 1, 0]}  # no hit: a's freed blocks, from the head


def test_a_cache_filling_request_next_to_another_one_finishes_after_self_preemptions():
    # 10 blocks, budget 16. s: 8 prompt + 8 new (4 blocks at most); r: 30 + 11 (exactly the whole cache).
    # r is the newest, so each time it runs out of blocks it preempts itself (steps 3, 5, 7) and restarts from 0:
    #   step 1: s 8 [0,1], r 8 [2,3]      step 2: s 1 [4], r 15 [5,6,7,8]   step 3: s 1, r needs 2 blocks, 1 free
    #   step 4: s 1, r 15 [9,8,7,6]       step 5: s 1, r needs 4, 3 free     step 6: s 1 [5], r 15 [3,2,6,7]
    #   step 7: s 1, r needs 4, 2 free    step 8: s 1 (8th token), r 15      step 9: r 15 (1st token)
    #   steps 10-19: r decodes its 10 remaining tokens
    sched = make_scheduler(num_blocks=10, budget=16)
    s = make_request("s", range(8), max_tokens=8)
    r = make_request("r", range(100, 130), max_tokens=11)
    sched.add_request(s)
    sched.add_request(r)
    history = []
    while sched.has_unfinished_requests():
        so = step(sched)
        history.append((so.num_scheduled_tokens.get("s", 0), so.num_scheduled_tokens.get("r", 0)))
        assert len(history) <= 19
    assert history == [(8, 8), (1, 15), (1, 0), (1, 15), (1, 0), (1, 15), (1, 0), (1, 15), (0, 15)] + [(0, 1)] * 10
    assert r.num_preemptions == 3
    assert (s.num_output_tokens, r.num_output_tokens) == (8, 11)
    assert sched.kv.pool.num_free_blocks == 10
