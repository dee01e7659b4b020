"""Draft tokens in the scheduler and the KV manager: they are scheduled after a request's known tokens, count in the
token budget and get KV slots; the runner's answer (accepted drafts + one sampled token) is cut at a stop, the
rejected drafts' slots are reused, and only accepted tokens' blocks enter the prefix cache.

Tiny configs (block_size 4); every expectation is traced by hand in the comments."""

from __future__ import annotations

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.engine.block_pool import hash_block_tokens
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.scheduler_output import ModelRunnerOutput

BS = 4


def make_scheduler(num_blocks=10, budget=32, caching=False, async_scheduling=False) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, async_scheduling=async_scheduling),
        CacheConfig(block_size=BS, enable_prefix_caching=caching),
        num_blocks,
    )


def make_request(req_id, prompt, max_tokens=10, **params) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, **params)
    return Request(req_id, list(prompt), sp, eos_token_id=0, max_tokens=max_tokens)


def answer(sched, so, tokens: dict[str, list[int]], logprobs=None):
    return sched.update_from_output(so, ModelRunnerOutput(tokens, logprobs or {}))


def prefilled(sched, req: Request, first_token: int = 7) -> Request:
    """Admits the request and runs its whole prompt in one step, sampling first_token."""
    sched.add_request(req)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {req.request_id: req.num_tokens}
    answer(sched, so, {req.request_id: [first_token]})
    return req


def test_drafts_follow_the_known_token_take_budget_and_slots():
    sched = make_scheduler()
    a = prefilled(sched, make_request("a", range(1, 7)))  # 6 prompt tokens in blocks [0, 1]; output 7 at position 6
    sched.set_drafts({"a": [1, 2, 3]})
    so = sched.schedule()  # position 6 (the known token 7) + drafts at 7, 8, 9: 10 positions need a third block
    assert so.num_scheduled_tokens == {"a": 4} and so.total_num_scheduled_tokens == 4
    assert so.scheduled_spec_decode_tokens == {"a": [1, 2, 3]}
    assert [(c.req_id, c.new_block_ids, c.num_computed_tokens) for c in so.cached_reqs] == [("a", [2], 6)]
    assert a.num_computed_tokens == 10 and a.num_output_placeholders == 1 and a.spec_token_ids == []

    (out,) = answer(sched, so, {"a": [1, 2, 9]})  # drafts 1, 2 accepted, 3 rejected (9 sampled there)
    assert out.new_token_ids == [1, 2, 9] and out.finish_reason is None
    assert a.output_token_ids == [7, 1, 2, 9] and a.num_output_placeholders == 0
    assert a.num_computed_tokens == 9  # position 9 held the rejected draft: computed again with 9
    assert (sched.num_draft_tokens, sched.num_accepted_tokens) == (3, 2)
    so = sched.schedule()  # no drafts now: one token, at position 9, in the block it already has
    assert so.num_scheduled_tokens == {"a": 1} and so.scheduled_spec_decode_tokens == {}
    assert [(c.new_block_ids, c.num_computed_tokens) for c in so.cached_reqs] == [([], 9)]


def test_all_drafts_rejected_rolls_back_to_the_known_tokens():
    sched = make_scheduler()
    a = prefilled(sched, make_request("a", range(1, 7)))
    sched.set_drafts({"a": [1, 2, 3]})
    so = sched.schedule()
    (out,) = answer(sched, so, {"a": [5]})
    assert out.new_token_ids == [5] and a.output_token_ids == [7, 5] and a.num_computed_tokens == 7
    sched.set_drafts({"a": [4, 4]})
    so = sched.schedule()  # position 7 (5) + drafts at 8, 9: blocks [0, 1, 2] already cover them
    assert so.num_scheduled_tokens == {"a": 3} and [c.new_block_ids for c in so.cached_reqs] == [[]]
    assert [c.num_computed_tokens for c in so.cached_reqs] == [7]


def test_drafts_are_capped_by_max_tokens_and_the_budget():
    sched = make_scheduler(budget=3)
    a = prefilled(sched, make_request("a", range(1, 4), max_tokens=10))  # 3 prompt tokens fit the budget
    sched.set_drafts({"a": [1, 2, 3, 4]})
    so = sched.schedule()  # budget 3: the known token + 2 drafts
    assert so.num_scheduled_tokens == {"a": 3} and so.scheduled_spec_decode_tokens == {"a": [1, 2]}
    answer(sched, so, {"a": [1, 2, 3]})  # 4 outputs now

    sched = make_scheduler()
    b = prefilled(sched, make_request("b", range(1, 4), max_tokens=3))
    sched.set_drafts({"b": [1, 2, 3, 4]})
    so = sched.schedule()  # 1 output, max 3: at most 1 draft (+ the sampled token = the 3rd output)
    assert so.scheduled_spec_decode_tokens == {"b": [1]} and so.num_scheduled_tokens == {"b": 2}
    (out,) = answer(sched, so, {"b": [1, 6]})
    assert out.new_token_ids == [1, 6] and out.finish_reason == "length" and b.output_token_ids == [7, 1, 6]
    assert a.num_output_tokens == 4 and not sched.has_unfinished_requests()


def test_drafts_only_where_the_scheduled_tokens_reach_the_end_of_the_known_ones():
    sched = make_scheduler(budget=4)
    a = make_request("a", range(1, 11))
    sched.add_request(a)
    answer(sched, sched.schedule(), {})  # 4 of 10 prompt tokens
    sched.set_drafts({"a": [1, 2]})  # a is running, but this chunk (4 more) leaves 2 prompt tokens: dropped
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 4} and so.scheduled_spec_decode_tokens == {}
    assert a.spec_token_ids == [] and a.num_output_placeholders == 0
    answer(sched, so, {})
    sched.set_drafts({"a": [1, 2, 3]})  # the last 2 prompt tokens + 2 drafts fill the budget
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 4} and so.scheduled_spec_decode_tokens == {"a": [1, 2]}
    assert a.num_computed_tokens == 12 and a.num_output_placeholders == 1
    (out,) = answer(sched, so, {"a": [1, 5]})
    assert out.new_token_ids == [1, 5] and a.num_computed_tokens == 11


def test_drafts_never_preempt_a_request():
    # 3 blocks: a (4 prompt tokens) and b (3) take a block each; a's drafts would need 2 more blocks, only 1 is free
    sched = make_scheduler(num_blocks=3)
    a = make_request("a", range(1, 5), max_tokens=8)
    b = make_request("b", range(10, 13), max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    answer(sched, sched.schedule(), {"a": [7], "b": [7]})
    sched.set_drafts({"a": [1, 2, 3, 4, 5]})  # positions 4-9: blocks for 10 tokens = 3, a has 1, 1 is free
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 1, "b": 1} and so.scheduled_spec_decode_tokens == {}
    assert so.preempted_req_ids == set() and b.status == RequestStatus.RUNNING
    assert sched.kv.block_ids("a") == [0, 2]


def test_a_preempted_request_drops_its_drafts():
    sched = make_scheduler(num_blocks=2)
    a = make_request("a", range(1, 5), max_tokens=5)
    b = make_request("b", range(10, 14), max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    answer(sched, sched.schedule(), {"a": [7], "b": [7]})  # blocks 0, 1: none free
    sched.set_drafts({"b": [1]})
    so = sched.schedule()  # a needs a block for position 4: b (newest, not scheduled yet) is preempted
    assert so.preempted_req_ids == {"b"} and so.num_scheduled_tokens == {"a": 1}
    assert b.status == RequestStatus.PREEMPTED and b.spec_token_ids == []


@pytest.mark.parametrize(
    "params, tokens, kept, reason, stop_reason",
    [
        ({}, [1, 0, 5], [1, 0], "stop", None),  # EOS (id 0) inside the list
        ({"stop_token_ids": [4]}, [4, 2, 3], [4], "stop", 4),
        ({"max_tokens": 3}, [1, 2, 3], [1, 2], "length", None),  # 1 output before: the 3rd ends it
        ({"ignore_eos": True}, [1, 0, 5], [1, 0, 5], None, None),
        ({"min_tokens": 4}, [0, 0, 5], [0, 0, 5], None, None),  # EOS before min_tokens does not stop
        ({"min_tokens": 3}, [0, 0, 5], [0, 0], "stop", None),  # the 3rd output may stop
    ],
)
def test_a_stop_inside_the_accepted_tokens_cuts_them_there(params, tokens, kept, reason, stop_reason):
    params = {"max_tokens": 10, **params}
    sched = make_scheduler()
    a = prefilled(sched, make_request("a", range(1, 7), **params))
    sched.set_drafts({"a": [9, 9, 9]})
    so = sched.schedule()
    n = len(so.scheduled_spec_decode_tokens["a"])
    logprobs = {"a": [([t], [-0.5 * i], [1]) for i, t in enumerate(tokens)]}
    (out,) = answer(sched, so, {"a": tokens[: n + 1]}, logprobs)
    assert out.new_token_ids == kept and a.output_token_ids == [7, *kept]
    assert out.finish_reason == reason and out.stop_reason == stop_reason
    assert out.new_logprobs == logprobs["a"][: len(kept)]
    assert sched.has_unfinished_requests() is (reason is None)
    if reason is not None:
        assert sched.kv.pool.num_free_blocks == 10


def test_more_tokens_than_drafts_plus_one_is_an_error():
    sched = make_scheduler()
    prefilled(sched, make_request("a", range(1, 7)))
    sched.set_drafts({"a": [1]})
    so = sched.schedule()
    with pytest.raises(RuntimeError, match="3 tokens for 1 drafts"):
        answer(sched, so, {"a": [1, 2, 3]})


def test_only_accepted_tokens_blocks_enter_the_prefix_cache():
    prompt = [11, 12, 13, 14, 15, 16]
    sched = make_scheduler(caching=True)
    a = prefilled(sched, make_request("a", prompt))  # output 7 at position 6: block 0 (positions 0-3) is cached
    assert sched.kv.num_cached_blocks["a"] == 1
    sched.set_drafts({"a": [1, 2, 3, 4, 5, 6]})  # positions 7-12
    so = sched.schedule()  # known tokens fill block 0 only: blocks of drafts are not hashed
    assert sched.kv.num_cached_blocks["a"] == 1 and len(sched.kv.pool.cached) == 1
    answer(sched, so, {"a": [1, 2, 8]})  # 1, 2 accepted at 7, 8; 8 sampled at 9; computed: positions 0-8
    assert a.num_computed_tokens == 9
    h0 = hash_block_tokens(None, prompt[:4])
    h1 = hash_block_tokens(h0, [15, 16, 7, 1])  # block 1 is full of computed, accepted tokens: cached now
    assert sched.kv.num_cached_blocks["a"] == 2 and set(sched.kv.pool.cached) == {h0, h1}
    assert sched.kv.pool.cached[h1].block_id == sched.kv.block_ids("a")[1]

    b = make_request("b", [*prompt, 7, 1, 2, 8])  # a's tokens so far: its first 8 are found in the cache
    sched.add_request(b)
    so = sched.schedule()
    assert so.new_reqs[0].num_computed_tokens == 8 and so.num_scheduled_tokens["b"] == 2
    assert sched.kv.block_ids("b")[:2] == sched.kv.block_ids("a")[:2]


def test_rejected_drafts_blocks_stay_out_of_the_prefix_cache():
    sched = make_scheduler(caching=True)
    a = prefilled(sched, make_request("a", [11, 12, 13, 14, 15, 16]))
    sched.set_drafts({"a": [1, 2, 3, 4, 5, 6]})
    so = sched.schedule()
    answer(sched, so, {"a": [9]})  # all rejected: position 7 holds draft 1's KV, not 9's
    assert a.num_computed_tokens == 7 and sched.kv.num_cached_blocks["a"] == 1 and len(sched.kv.pool.cached) == 1
    so = sched.schedule()  # position 7 computed again with 9: block 1 (15, 16, 7, 9) is full of known tokens
    assert so.num_scheduled_tokens == {"a": 1} and sched.kv.num_cached_blocks["a"] == 2


def test_async_scheduling_schedules_no_drafts():
    sched = make_scheduler(async_scheduling=True)
    a = prefilled(sched, make_request("a", range(1, 7)))
    sched.set_drafts({"a": [1, 2]})
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 1} and so.scheduled_spec_decode_tokens == {}
    assert a.spec_token_ids == []


def test_set_drafts_replaces_every_running_requests_drafts():
    sched = make_scheduler()
    a = prefilled(sched, make_request("a", range(1, 7)))
    sched.set_drafts({"a": [1, 2]})
    sched.set_drafts({})
    assert a.spec_token_ids == []
    assert sched.schedule().num_scheduled_tokens == {"a": 1}


@pytest.mark.parametrize(
    "num_blocks, max_model_len, params, new_blocks",
    [
        (10, 64, {}, [2, 3]),  # positions 6..9 scheduled + 3 lookahead (10..12): 13 slots, blocks 0..3
        (3, 64, {}, [2]),  # no room for the lookahead: the step goes on without it (nothing preempted)
        (10, 11, {}, [2]),  # within max_model_len: 1 lookahead slot (position 10)
        (10, 64, {"logits_processors": [lambda _, x: x]}, []),  # a request that may not speculate: none
    ],
)
def test_lookahead_slots_for_the_draft_models_writes(num_blocks, max_model_len, params, new_blocks):
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=32, max_model_len=max_model_len),
        CacheConfig(block_size=BS, enable_prefix_caching=False),
        num_blocks,
    )
    sched.num_lookahead_tokens = 3
    a = prefilled(sched, make_request("a", range(1, 7), max_tokens=5, **params))  # blocks [0, 1]; 7 at position 6
    sched.set_drafts({"a": [1, 2, 3]} if not params else {})
    so = sched.schedule()
    assert [c.new_block_ids for c in so.cached_reqs] == [new_blocks] and sched.num_preemptions == 0
    assert a.num_computed_tokens == (10 if not params else 7)  # lookahead slots are not computed tokens
    answer(sched, so, {"a": [1, 2, 9] if not params else [5]})
    assert sched.kv.req_to_blocks["a"][: 2 + len(new_blocks)] == sched.kv.req_to_blocks["a"]  # kept, not freed
