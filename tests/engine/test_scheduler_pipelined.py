"""The scheduler under pipeline parallelism (pipeline_depth steps in flight): a request with a step in flight is
neither scheduled again nor preempted, the running requests split into even batches, and a request that ends while
a step of it is in flight reaches the runners only once that step is done."""

from __future__ import annotations

import pytest
from test_scheduler import make_request, make_scheduler

from pagedllm.engine.request import RequestStatus
from pagedllm.worker.scheduler_output import ModelRunnerOutput


def _pipelined(**kwargs):
    sched = make_scheduler(**kwargs)
    sched.pipeline_depth = 2
    return sched


def _done(sched, so, token: int = 7):
    """The step's answer: a token for each request that sampled in it (an ended one's too: the runner sampled it)."""
    sampled = {
        r: [token]
        for r in so.num_scheduled_tokens
        if r not in sched.requests or sched.requests[r].num_output_placeholders
    }
    return sched.update_from_output(so, ModelRunnerOutput(sampled_token_ids=sampled))


def test_requests_in_flight_are_skipped_and_batches_split_evenly():
    sched = _pipelined()
    for name in "abcd":
        sched.add_request(make_request(name, range(3), max_tokens=5))
    so1 = sched.schedule()  # the four prefills
    assert set(so1.num_scheduled_tokens) == set("abcd")
    assert sched.schedule().num_scheduled_tokens == {}  # every request has a step in flight
    _done(sched, so1)
    so2, so3 = sched.schedule(), sched.schedule()  # half of the running requests each, disjoint
    assert so2.num_scheduled_tokens == {"a": 1, "b": 1} and so3.num_scheduled_tokens == {"c": 1, "d": 1}
    assert sched.schedule().num_scheduled_tokens == {}
    _done(sched, so2)
    assert sched.schedule().num_scheduled_tokens == {"a": 1, "b": 1}  # c and d are still in flight


def test_single_stage_schedules_every_running_request():
    sched = make_scheduler()  # pipeline_depth 0: the usual scheduling
    for name in "abcd":
        sched.add_request(make_request(name, range(3), max_tokens=5))
    _done(sched, sched.schedule())
    assert sched.schedule().num_scheduled_tokens == dict.fromkeys("abcd", 1)


def test_a_request_in_flight_is_not_preempted():
    # 3 blocks of 4: a (3 prompt tokens) and b (4) take a block each; b's decode at position 4 takes the third;
    # then a needs a block at position 4 while b's step is in flight: a preempts itself, not the newer b
    sched = _pipelined(num_blocks=3)
    a, b = make_request("a", range(3), max_tokens=8), make_request("b", range(10, 14), max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    _done(sched, sched.schedule())
    so_a = sched.schedule()
    so_b = sched.schedule()
    assert so_a.num_scheduled_tokens == {"a": 1} and so_b.num_scheduled_tokens == {"b": 1}
    assert sched.kv.block_ids("b") == [1, 2]
    _done(sched, so_a)
    so = sched.schedule()
    assert so.preempted_req_ids == {"a"} and so.num_scheduled_tokens == {}
    assert a.status == RequestStatus.PREEMPTED and b.status == RequestStatus.RUNNING
    (out,) = _done(sched, so_b)
    assert out.req_id == "b" and b.output_token_ids == [7, 7]


def test_request_ended_in_flight_reaches_the_runners_after_its_step():
    sched = _pipelined(max_num_seqs=2)
    a, b = make_request("a", range(3), max_tokens=5), make_request("b", range(3), max_tokens=5)
    sched.add_request(a)
    so1 = sched.schedule()
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)  # a's step is in flight
    with pytest.raises(ValueError, match="already in use"):  # its runner row is still taken
        sched.add_request(make_request("a", range(3), max_tokens=5))
    sched.add_request(b)
    c = make_request("c", range(3), max_tokens=5)
    sched.add_request(c)
    so2 = sched.schedule()  # a's row counts toward max_num_seqs=2: b joins, c waits
    assert so2.finished_req_ids == set() and so2.num_scheduled_tokens == {"b": 3}
    assert _done(sched, so1) == []  # the aborted request's token is dropped
    so3 = sched.schedule()
    assert so3.finished_req_ids == {"a"} and so3.num_scheduled_tokens == {"c": 3}
    assert not sched.ended_in_flight


def test_released_step_lets_its_requests_run_again_on_placeholders():
    """Once a step's sampling is queued (release_step), its requests are scheduled again before their tokens come
    back, each placeholder the input of the next step; the other batch stays in flight."""
    sched = _pipelined()
    for name in "abcd":
        sched.add_request(make_request(name, range(3), max_tokens=3))
    _done(sched, sched.schedule())
    so2, so3 = sched.schedule(), sched.schedule()
    assert so3.num_scheduled_tokens == {"c": 1, "d": 1}
    assert sched.schedule().num_scheduled_tokens == {}  # a, b, c and d in flight
    sched.release_step(so2.step_id)
    so4 = sched.schedule()
    assert so4.num_scheduled_tokens == {"a": 1, "b": 1}  # c and d are still in flight, not yet sampled
    a = sched.requests["a"]
    assert a.num_output_placeholders == 2 and a.num_computed_tokens == 5  # prompt 3 + token 1 + so2's placeholder
    sched.release_step(so4.step_id)  # a's third token would be its last: it waits for its placeholders
    assert sched.schedule().num_scheduled_tokens == {}
    _done(sched, so2, token=8)
    (out_a,) = [o for o in _done(sched, so4, token=9) if o.req_id == "a"]
    assert a.output_token_ids == [7, 8, 9] and out_a.finish_reason == "length"
    assert not sched.released and so2.step_id not in sched.step_reqs
