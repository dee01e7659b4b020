"""Async scheduling end to end on the bundled SmolLM2 (float32, CPU): scheduling step N+1 before step N's tokens
reach the host changes no output. The reference is the same engine scheduling synchronously; the cache is small
enough to preempt and the token budget small enough to chunk prefills, so both paths meet placeholders there too."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):",
    "List three colors:",
    "The quick brown fox",
    "Water boils at",
]
CASES = {
    "greedy": SamplingParams(temperature=0, max_tokens=24),
    "seeded, logprobs": SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, logprobs=2),
    "penalties": SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, max_tokens=16),
    "stop string, min_tokens": SamplingParams(temperature=0, stop=[" the"], min_tokens=2, max_tokens=30),
    "n=2 seeded": SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=10),
    "prompt logprobs": SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2),
    "bad words": SamplingParams(temperature=0, bad_words=["the", "a"], max_tokens=12),
}


def engine(path: str, async_scheduling: bool) -> LLM:
    # 10 blocks of 16 tokens for 6 requests of up to ~40 tokens: preemption; 16-token budget: chunked prefill
    llm = LLM(
        path,
        dtype="float32",
        async_scheduling=async_scheduling,
        num_gpu_blocks_override=10,
        max_num_batched_tokens=16,
    )
    assert llm.llm_engine.config.scheduler.async_scheduling is async_scheduling
    return llm


@pytest.fixture(scope="module")
def engines(smollm2):
    return engine(smollm2, False), engine(smollm2, True)


def summary(outs) -> tuple[list, list[float]]:
    """(everything but the float logprob values, those values): the batches of the two paths may differ (a
    request ended by EOS still runs one step with async scheduling), so the floats may differ in the last bits."""
    exact, floats = [], []
    for o in outs:
        for c in o.outputs:
            exact.append((c.token_ids, c.text, c.finish_reason, c.stop_reason))
            if c.logprobs is not None:
                exact.append([sorted(d) for d in c.logprobs])
                floats += [c.cumulative_logprob] + [lp.logprob for d in c.logprobs for lp in d.values()]
        if o.prompt_logprobs:
            exact.append([sorted(d) if d else None for d in o.prompt_logprobs])
            floats += [lp.logprob for d in o.prompt_logprobs if d for lp in d.values()]
    return exact, floats


@pytest.mark.parametrize("case", list(CASES))
def test_async_gives_the_same_outputs(engines, case):
    sync, async_ = engines
    params = CASES[case]
    before = async_.llm_engine.core.scheduler.num_preemptions
    expected, expected_floats = summary(sync.generate(PROMPTS, params, use_tqdm=False))
    got, got_floats = summary(async_.generate(PROMPTS, params, use_tqdm=False))
    assert got == expected
    assert got_floats == pytest.approx(expected_floats, abs=1e-4)
    if case == "greedy":
        assert async_.llm_engine.core.scheduler.num_preemptions > before  # the small cache did preempt


def test_async_engine_is_idle_after_each_call(engines):
    _, async_ = engines
    eng = async_.llm_engine
    async_.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert not eng.has_unfinished_requests() and not eng.core.in_flight
    assert eng.core.scheduler.kv.pool.usage() == 0


def test_async_abort_while_a_step_is_on_the_device(engines):
    _, async_ = engines
    eng = async_.llm_engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    eng.add_request("keep", async_.get_tokenizer().encode(PROMPTS[0]), params)
    eng.add_request("drop", async_.get_tokenizer().encode(PROMPTS[1]), params)
    finished = []
    for _ in range(4):
        finished += [o for o in eng.step() if o.finished]
    assert eng.core.in_flight
    eng.abort_request(["drop"])
    while eng.has_unfinished_requests():
        finished += [o for o in eng.step() if o.finished]
    (out,) = finished
    assert out.request_id == "keep" and len(out.outputs[0].token_ids) == 20
    assert eng.core.scheduler.kv.pool.usage() == 0


def test_async_request_id_used_again_while_a_step_is_on_the_device(engines):
    """A request aborted with a step in flight, then a new request with the same id: the old step's token must not
    reach the new request (its row is given straight back to the same id)."""
    sync, async_ = engines
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = sync.generate([PROMPTS[2]], params, use_tqdm=False)[0].outputs[0].token_ids
    eng, tok = async_.llm_engine, async_.get_tokenizer()
    eng.add_request("x", tok.encode(PROMPTS[0]), params)
    for _ in range(3):
        eng.step()
    assert eng.core.in_flight
    eng.abort_request(["x"])
    eng.add_request("x", tok.encode(PROMPTS[2]), params)
    finished = []
    while eng.has_unfinished_requests():
        finished += [o for o in eng.step() if o.finished]
    (out,) = finished
    assert out.request_id == "x" and out.outputs[0].token_ids == expected


def test_async_failing_launch_ends_its_requests_and_the_engine_serves_on(engines, monkeypatch):
    _, async_ = engines
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = async_.generate([PROMPTS[1]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    runner = async_.llm_engine.core.executor.runner
    calls = []

    def broken(so):
        calls.append(so)
        if len(calls) == 3:  # a decode step, with the previous step still to be read
            raise RuntimeError("simulated failure inside the model")
        return launch(so)

    launch = runner.launch
    monkeypatch.setattr(runner, "launch", broken)
    with pytest.raises(RuntimeError, match="simulated"):
        async_.generate([PROMPTS[1]], greedy, use_tqdm=False)
    monkeypatch.undo()
    eng = async_.llm_engine
    while eng.has_unfinished_requests():  # the step still on the device is read; its request has ended
        assert eng.step() == []
    assert async_.generate([PROMPTS[1]], greedy, use_tqdm=False)[0].outputs[0].token_ids == expected


def test_async_launches_two_steps_ahead_of_the_outputs(engines, monkeypatch):
    """A step returns step N's outputs with N+1 and N+2 already launched: the outputs' processing (detokenizing,
    stop strings) overlaps the device. The update from N comes right before N+2 is scheduled."""
    _, async_ = engines
    eng, core = async_.llm_engine, async_.llm_engine.core
    events = []
    update, schedule = core.scheduler.update_from_output, core.scheduler.schedule

    def logged_update(so, out):
        events.append(("update", so.step_id))
        return update(so, out)

    def logged_schedule():
        so = schedule()
        events.append(("schedule", so.step_id))
        return so

    monkeypatch.setattr(core.scheduler, "update_from_output", logged_update)
    monkeypatch.setattr(core.scheduler, "schedule", logged_schedule)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    eng.add_request("a", async_.get_tokenizer().encode(PROMPTS[3]), params)
    in_flight_at_return = []
    while eng.has_unfinished_requests():
        eng.step()
        in_flight_at_return.append([step.so.step_id for step in core.in_flight])
    first = events[0][1]
    steps = [s - first for kind, s in events if kind == "update"]
    assert steps == list(range(len(steps)))
    for n in steps[:-2]:  # every update but the last two (nothing left to schedule) is followed by N+2's schedule
        i = events.index(("update", n + first))
        assert events[i + 1] == ("schedule", n + first + 2)
    assert in_flight_at_return[:4] == [[first + n + 1, first + n + 2] for n in range(4)]
