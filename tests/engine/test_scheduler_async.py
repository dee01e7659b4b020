"""The scheduler with asynchronous scheduling: steps decode on placeholders for the token still on the device."""

from __future__ import annotations

from test_scheduler import make_request, make_scheduler

from pagedllm.engine.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.scheduler_output import ModelRunnerOutput


# -- async scheduling: step N+1 is scheduled before step N's tokens come back ------------------------------------
def test_async_schedule_decodes_on_placeholders_and_stops_at_max_tokens():
    sched = make_scheduler()
    a = make_request("a", range(5), max_tokens=3)
    sched.add_request(a)
    so1 = sched.schedule()  # prefill of 5 tokens, samples output 1
    assert so1.num_scheduled_tokens == {"a": 5} and a.num_output_placeholders == 1
    so2 = sched.schedule()  # before so1's token is back: decodes the placeholder, samples output 2
    assert so2.num_scheduled_tokens == {"a": 1} and a.num_computed_tokens == 6 and a.num_output_placeholders == 2
    assert sched.kv.block_ids("a") == [0, 1]  # positions 0-5 in two blocks of 4
    (out,) = sched.update_from_output(so1, ModelRunnerOutput(sampled_token_ids={"a": [11]}))
    assert out.new_token_ids == [11] and out.finish_reason is None
    assert a.all_token_ids == [0, 1, 2, 3, 4, 11] and a.num_output_placeholders == 1
    so3 = sched.schedule()  # output 3 is the last one allowed: scheduled
    assert so3.num_scheduled_tokens == {"a": 1} and a.num_output_placeholders == 2
    so4 = sched.schedule()  # 1 known + 2 on the device = max_tokens: nothing to do until they come back
    assert so4.num_scheduled_tokens == {}
    sched.update_from_output(so2, ModelRunnerOutput(sampled_token_ids={"a": [12]}))
    (out,) = sched.update_from_output(so3, ModelRunnerOutput(sampled_token_ids={"a": [13]}))
    assert out.finish_reason == "length" and a.output_token_ids == [11, 12, 13]
    assert a.num_output_placeholders == 0 and not sched.has_unfinished_requests()


def test_async_token_after_eos_is_dropped():
    sched = make_scheduler()
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=10), eos_token_id=0, max_tokens=10)
    sched.add_request(a)
    so1 = sched.schedule()
    so2 = sched.schedule()  # runs on before so1's EOS is known
    (out,) = sched.update_from_output(so1, ModelRunnerOutput(sampled_token_ids={"a": [0]}))
    assert out.finish_reason == "stop" and a.output_token_ids == [0]
    assert sched.update_from_output(so2, ModelRunnerOutput(sampled_token_ids={"a": [5]})) == []
    assert a.output_token_ids == [0] and sched.schedule().finished_req_ids == {"a"}


def test_async_preemption_drops_the_token_on_the_device():
    # 3 blocks of 4: a (4 prompt tokens) and b (3) fill a block each; a's decode at position 4 takes the third,
    # b's at position 3 fits its block; then a needs no block, b needs one at position 4: b (newest) is preempted
    sched = make_scheduler(num_blocks=3)
    a, b = make_request("a", range(4), max_tokens=8), make_request("b", range(10, 13), max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    so1 = sched.schedule()
    assert so1.num_scheduled_tokens == {"a": 4, "b": 3}
    so2 = sched.schedule()  # placeholders: a at position 4 (new block 2), b at position 3
    assert so2.num_scheduled_tokens == {"a": 1, "b": 1} and sched.kv.block_ids("a") == [0, 2]
    so3 = sched.schedule()  # b needs a block for position 4: none free, b is preempted with 2 tokens on the device
    assert so3.num_scheduled_tokens == {"a": 1} and so3.preempted_req_ids == {"b"}
    assert b.status == RequestStatus.PREEMPTED and b.num_output_placeholders == 0 and b.num_computed_tokens == 0
    sched.update_from_output(so1, ModelRunnerOutput(sampled_token_ids={"a": [7], "b": [7]}))
    sched.update_from_output(so2, ModelRunnerOutput(sampled_token_ids={"a": [8], "b": [8]}))
    assert b.num_tokens == 3 and a.output_token_ids == [7, 8]  # b's tokens were dropped, a's kept


def test_async_token_of_an_aborted_request_never_reaches_a_new_one_with_its_id():
    sched = make_scheduler()
    old = make_request("x", range(4), max_tokens=5)
    sched.add_request(old)
    so1 = sched.schedule()  # old x samples; its token is still on the device
    sched.finish_requests(["x"], RequestStatus.FINISHED_ABORTED)
    new = make_request("x", range(10, 14), max_tokens=5)
    sched.add_request(new)
    so2 = sched.schedule()
    assert so2.num_scheduled_tokens == {"x": 4} and new.num_output_placeholders == 1
    assert sched.update_from_output(so1, ModelRunnerOutput(sampled_token_ids={"x": [99]})) == []
    assert new.output_token_ids == [] and new.num_output_placeholders == 1
    (out,) = sched.update_from_output(so2, ModelRunnerOutput(sampled_token_ids={"x": [5]}))
    assert out.new_token_ids == [5] and new.output_token_ids == [5]
