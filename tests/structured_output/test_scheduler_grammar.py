"""The scheduler's side of structured outputs, with a stand-in grammar (no xgrammar): a request waits while its
grammar compiles (keeping its place), only rows that sample get a bitmask (the grammar's, for the tokens it has),
the grammar takes each sampled token and ends the request when it terminates, and with async scheduling a
constrained request is scheduled on its placeholder, its mask filled once its last token is in (with pipeline
stages it waits for that token instead). Drafts (speculative decoding) are cut
at the first token the grammar refuses, each verified position gets its own mask, and the grammar takes only the
emitted tokens."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import pytest

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.engine.request import Request
from pagedllm.engine.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.scheduler_output import ModelRunnerOutput


class StandInGrammar:
    """Allows one token: the length of what it accepted so far; terminates after `length` tokens."""

    num_words = 2

    def __init__(self, length: int, ready: bool = True) -> None:
        self.compiled: Future = Future()
        if ready:
            self.compiled.set_result(None)
        self.length, self.accepted = length, []

    def ready(self) -> bool:
        return self.compiled.done()

    def error(self):
        return self.compiled.exception() if self.compiled.done() else None

    def accept(self, tokens: list[int]) -> int:
        for i, t in enumerate(tokens):
            if t != len(self.accepted):
                return i
            self.accepted.append(t)
        return len(tokens)

    def rollback(self, num_tokens: int) -> None:
        del self.accepted[len(self.accepted) - num_tokens :]

    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.length

    def is_completed(self) -> bool:
        return self.is_terminated()

    def batch_filler(self):
        return None  # filled row by row

    def fill_bitmask(self, out, row: int) -> None:
        out[row] = 0
        out[row, 0] = 1 << len(self.accepted)


def make(async_scheduling: bool = False, budget: int = 32) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, async_scheduling=async_scheduling)
    return Scheduler(config, CacheConfig(block_size=4, enable_prefix_caching=False), 20)


def request(req_id: str, grammar=None, prompt_len: int = 5) -> Request:
    req = Request(req_id, list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=8), 99, 8)
    req.grammar = grammar
    return req


def answer(sched: Scheduler, so, tokens: dict[str, int]):
    return sched.update_from_output(so, ModelRunnerOutput({r: [t] for r, t in tokens.items()}))


def test_waits_for_its_grammar_in_its_place():
    sched = make()
    g = StandInGrammar(3, ready=False)
    sched.add_request(request("a", g))
    sched.add_request(request("b"))
    so = sched.schedule()
    assert list(so.num_scheduled_tokens) == ["b"] and so.grammar_bitmask == {}
    assert [r.request_id for r in sched.waiting] == ["a"]
    g.compiled.set_result(None)
    answer(sched, so, {"b": 1})
    so = sched.schedule()
    assert list(so.num_scheduled_tokens) == ["b", "a"]
    assert list(so.grammar_bitmask) == ["a"] and so.grammar_bitmask["a"].dtype == np.int32
    assert so.grammar_bitmask["a"].tolist() == [1, 0]  # token 0 allowed


def test_mask_only_where_it_samples_and_the_grammar_ends_the_request():
    sched = make(budget=3)  # the 5-token prompt takes two steps: no mask on the first chunk
    g = StandInGrammar(2)
    sched.add_request(request("a", g))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 3} and so.grammar_bitmask == {}
    answer(sched, so, {})
    so = sched.schedule()
    assert so.grammar_bitmask["a"].tolist() == [1, 0]
    (out,) = answer(sched, so, {"a": 0})
    assert out.new_token_ids == [0] and out.finish_reason is None and g.accepted == [0]
    so = sched.schedule()
    assert so.grammar_bitmask["a"].tolist() == [2, 0]  # the mask follows the accepted tokens
    (out,) = answer(sched, so, {"a": 1})
    assert out.finish_reason == "stop" and not sched.has_unfinished_requests()


def test_refused_token_is_dropped():
    sched = make()
    g = StandInGrammar(5)
    sched.add_request(request("a", g))
    so = sched.schedule()
    (out,) = answer(sched, so, {"a": 7})  # not the allowed token 0
    assert out.new_token_ids == [] and out.finish_reason == "abort"
    assert sched.requests == {}


def test_async_schedules_a_constrained_request_on_its_placeholder_its_mask_deferred():
    sched = make(async_scheduling=True)
    g, ends = StandInGrammar(3), StandInGrammar(1)
    sched.add_request(request("a", g))
    sched.add_request(request("b"))
    sched.add_request(request("c", ends))
    so1 = sched.schedule()  # all prefill and sample: the masks follow the tokens known
    assert set(so1.grammar_bitmask) == {"a", "c"} and not so1.grammar_bitmask.deferred
    assert so1.grammar_bitmask["a"].tolist() == [1, 0]
    so2 = sched.schedule()  # all decode on their placeholders; the masks wait for step 1's tokens
    assert list(so2.num_scheduled_tokens) == ["a", "b", "c"] and so2.grammar_bitmask.deferred
    with pytest.raises(RuntimeError, match="read before they were filled"):
        so2.grammar_bitmask["a"]
    assert sched.start_masks(so1) is False  # (not deferred)
    outs = answer(sched, so1, {"a": 0, "b": 5, "c": 0})
    assert [o.finish_reason for o in outs] == [None, None, "stop"]  # c's grammar terminated
    assert sched.start_masks(so2) is True
    assert so2.grammar_bitmask["a"].tolist() == [2, 0]  # after the token 0 it took
    assert so2.grammar_bitmask.get("c") is None  # ended: its row allows every token, its token is dropped
    outs = answer(sched, so2, {"a": 1, "b": 6, "c": 3})
    assert [(o.req_id, o.new_token_ids) for o in outs] == [("a", [1]), ("b", [6])]


def test_pipelined_never_schedules_a_constrained_request_on_its_placeholder():
    sched = make(async_scheduling=True)
    sched.defer_masks = False  # as the engine core sets it with pipeline stages
    g = StandInGrammar(3)
    sched.add_request(request("a", g))
    sched.add_request(request("b"))
    so1 = sched.schedule()  # both prefill and sample
    assert set(so1.grammar_bitmask) == {"a"}
    so2 = sched.schedule()  # b decodes on its placeholder; a waits for its token
    assert list(so2.num_scheduled_tokens) == ["b"] and so2.grammar_bitmask == {}
    answer(sched, so1, {"a": 0, "b": 5})
    so3 = sched.schedule()
    assert "a" in so3.num_scheduled_tokens and so3.grammar_bitmask["a"].tolist() == [2, 0]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_drafts_cut_by_the_grammar_and_a_mask_per_position(async_scheduling):
    sched = make(async_scheduling=async_scheduling)
    sched.drafts_enabled = True  # as the engine core sets it for its synchronous steps (drafts need them)
    g = StandInGrammar(8)
    sched.add_request(request("a", g))
    answer(sched, sched.schedule(), {"a": 0})
    sched.set_drafts({"a": [1, 2, 9, 4]})  # 9 is refused: it and the drafts after it are cut
    assert sched.requests["a"].spec_token_ids == [1, 2] and g.accepted == [0]
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 3} and so.scheduled_spec_decode_tokens == {"a": [1, 2]}
    assert so.grammar_bitmask["a"].tolist() == [[2, 0], [4, 0], [8, 0]]  # after 0; after 0, 1; after 0, 1, 2
    assert g.accepted == [0]  # rolled back after filling the masks
    if async_scheduling:  # the mask of its next step needs the tokens this one emits
        assert sched.schedule().num_scheduled_tokens == {}
    (out,) = sched.update_from_output(so, ModelRunnerOutput({"a": [1, 5]}))  # draft 1 accepted, then 5
    assert out.new_token_ids == [1] and out.finish_reason == "abort"  # 5 was not allowed (only a rule overrides)
    assert g.accepted == [0, 1]


def test_accepted_drafts_advance_the_grammar():
    sched = make()
    g = StandInGrammar(8)
    sched.add_request(request("a", g))
    answer(sched, sched.schedule(), {"a": 0})
    sched.set_drafts({"a": [1, 2, 7]})
    so = sched.schedule()
    assert so.scheduled_spec_decode_tokens == {"a": [1, 2]}
    (out,) = sched.update_from_output(so, ModelRunnerOutput({"a": [1, 2, 3]}))  # both accepted, then 3
    assert out.new_token_ids == [1, 2, 3] and g.accepted == [0, 1, 2, 3] and out.finish_reason is None
    sched.set_drafts({"a": [4, 5]})
    assert sched.schedule().grammar_bitmask["a"].tolist() == [[16, 0], [32, 0], [64, 0]]
