"""The async engine core's order around deferred grammar masks and failures, with a real Scheduler, a stand-in
grammar and a fake executor whose sampling reads the masks (and fails where they were never filled)."""

from __future__ import annotations

import time
from collections import deque
from types import SimpleNamespace

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.engine.core import EngineCore
from pagedllm.engine.request import Request
from pagedllm.engine.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.scheduler_output import ModelRunnerOutput
from tests.structured_output.test_scheduler_grammar import StandInGrammar

EVENTS = []


class FakeFuture:
    def __init__(self, so):
        self.so, self.masks = so, None

    def sample(self):
        if self.masks is None:
            bm = self.so.grammar_bitmask
            self.masks = {r: bm.get(r) for r in bm} if bm else {}  # raises if deferred and never started
            EVENTS.append(("sample", self.so.step_id))
        return self

    def result(self):
        self.sample()
        toks = {}
        for r in self.so.num_scheduled_tokens:
            m = self.masks.get(r)
            toks[r] = [int(m[0]).bit_length() - 1] if m is not None else [5]
        return ModelRunnerOutput(toks)


class FakeExecutor:
    def execute_model(self, so):
        return self.launch(so).result()

    def launch(self, so):
        EVENTS.append(("launch", so.step_id))
        f = FakeFuture(so)
        if not getattr(so.grammar_bitmask, "deferred", False):
            f.sample()
        return f


def make_core():
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, async_scheduling=True)
    sched = Scheduler(cfg, CacheConfig(block_size=4, enable_prefix_caching=False), 40)
    sched.defer_masks = True
    core = EngineCore.__new__(EngineCore)
    core.scheduler, core.executor = sched, FakeExecutor()
    core.in_flight, core.batch_queue, core.launch_error = deque(), deque(), None
    core.pipeline_depth, core.async_steps = 0, True
    core.config = SimpleNamespace(speculative_proposer=SimpleNamespace(propose=lambda ids: {}))
    core.draft_policy = SimpleNamespace(select=lambda running: [], record=lambda *a: None)
    upd = sched.update_from_output

    def logged(so, out):
        time.sleep(0.02)  # a filler thread started too early would run first
        EVENTS.append(("update", so.step_id))
        return upd(so, out)

    sched.update_from_output = logged
    orig_start = sched.start_masks

    def start(so):
        r = orig_start(so)
        if r:
            EVENTS.append(("start", so.step_id))
        return r

    sched.start_masks = start
    return core


def req(rid, grammar=None):
    r = Request(rid, list(range(10, 15)), SamplingParams(max_tokens=8, ignore_eos=True), 99, 8)
    r.grammar = grammar
    return r


def deferred_behind(core) -> None:
    """Brings two steps in flight, the newer one's masks waiting for the older one's tokens (request "a"
    constrained, "b" not)."""
    core.scheduler.add_request(req("b"))
    core.step()
    core.scheduler.add_request(req("a", StandInGrammar(6)))
    core.step()
    core.step()
    assert [s.masks_wait for s in core.in_flight] == [False, True]


def test_masks_follow_the_update_when_steps_turn_synchronous_with_drafts():
    """Two steps in flight, the newer one's masks waiting for the older one's tokens, when the batch falls within
    disable_by_batch_size: the older step's update comes before the masks start, and the constrained request gets
    the tokens its grammar allows."""
    EVENTS.clear()
    core = make_core()
    drafting = [False]
    core._drafting = lambda: drafting[0]
    deferred_behind(core)
    older, newer = (s.so.step_id for s in core.in_flight)
    drafting[0] = True
    outs = []
    while core.has_unfinished_requests() and len(EVENTS) < 200:
        outs += core.step()
    assert EVENTS.index(("update", older)) < EVENTS.index(("start", newer))
    assert [t for o in outs if o.req_id == "a" for t in o.new_token_ids] == [0, 1, 2, 3, 4, 5]


def test_a_failed_update_still_starts_the_masks_behind_it():
    EVENTS.clear()
    core = make_core()
    core._drafting = lambda: False
    deferred_behind(core)
    update = core.scheduler.update_from_output
    calls = []

    def failing(so, out):
        if not calls:
            calls.append(so.step_id)
            raise RuntimeError("update failed")
        return update(so, out)

    core.scheduler.update_from_output = failing
    with pytest.raises(RuntimeError, match="update failed"):
        core.step()
    core.abort_requests(["a", "b"])  # (what the engine does after a failed step)
    while core.has_unfinished_requests() and len(EVENTS) < 200:
        core.step()  # the step behind it samples from filled masks (its fake sampling raises otherwise)
    assert not core.has_unfinished_requests()


def test_a_failed_launch_after_an_update_keeps_that_update_s_outputs():
    """N's update has ended a request; launching N+2 then fails: the call returns N's outputs, the next one raises
    the failure, and the engine goes on."""
    EVENTS.clear()
    core = make_core()
    core._drafting = lambda: False
    core.scheduler.add_request(Request("c", list(range(10, 15)), SamplingParams(max_tokens=2, ignore_eos=True), 99, 2))
    core.scheduler.add_request(req("b"))
    outs = core.step()
    launch = core.executor.launch
    core.executor.launch = lambda so: (_ for _ in ()).throw(RuntimeError("launch failed"))
    outs += core.step()
    assert [o.finish_reason for o in outs if o.req_id == "c"][-1] == "length"
    core.executor.launch = launch
    assert core.has_unfinished_requests()
    with pytest.raises(RuntimeError, match="launch failed"):
        core.step()
    while core.has_unfinished_requests() and len(EVENTS) < 200:
        outs += core.step()
    assert not core.has_unfinished_requests()
