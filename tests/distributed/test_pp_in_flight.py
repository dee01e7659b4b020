"""Pipeline parallelism with as many steps in flight as there are stages: PP=2 and TP=2 x PP=2 over CPU processes
(gloo, float32) give the tokens and logprobs of one process with many requests (two batches really in flight at
once), with prefix caching, chunked prefill, preemption, n > 1, seeded sampling, prompt logprobs and an abort of a
request whose step is in flight. The engine launches a batch's next step after queueing its sampling and before
waiting for its tokens (the order of the executor's calls is recorded)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import TINY_DECODER, save_tiny_decoder
from transformers import LlamaConfig, LlamaForCausalLM

from pagedllm import LLM, SamplingParams

# 24 tokens a step: prompts are cut into chunks; 40 blocks of 4 tokens for 10 requests of up to 50: preemption
ENGINE = dict(
    dtype="float32",
    skip_tokenizer_init=True,
    block_size=4,
    max_num_batched_tokens=24,
    num_gpu_blocks_override=40,
    enable_prefix_caching=True,
)


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    """Three layers (two stages: 2 + 1), tied embeddings."""
    kwargs = dict(TINY_DECODER, num_hidden_layers=3, tie_word_embeddings=True)
    _, path = save_tiny_decoder("llama-pp-flight", LlamaConfig, LlamaForCausalLM, kwargs, tmp_path_factory)
    return path


def _prompts(n: int = 10) -> list[dict]:
    gen = torch.Generator().manual_seed(11)
    lengths = [33, *torch.randint(1, 40, (n - 1,), generator=gen).tolist()]
    return [{"prompt_token_ids": torch.randint(0, 320, (k,), generator=gen).tolist()} for k in lengths]


def _params(n: int) -> list[SamplingParams]:
    kinds = [
        lambda i: SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2),
        lambda i: SamplingParams(temperature=0.9, top_p=0.9, n=2, seed=i, max_tokens=10, ignore_eos=True, logprobs=1),
        lambda i: SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=1),
    ]
    return [kinds[i % 3](i) for i in range(n)]


def _run(path: str, layout: tuple[int, int]):
    """(outputs of the requests, of some of them again (prefix-cache hits), of an engine run with an abort,
    preemptions, the most batches in flight at once, whether the abort hit a request in flight)."""
    tp, pp = layout
    llm = LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE)
    core = llm.llm_engine.core
    events: list = []
    if pp > 1:
        core.executor = Recording(core.executor, events)
    try:
        prompts = _prompts()
        first = llm.generate(prompts, _params(len(prompts)), use_tqdm=False)
        core.executor = getattr(core.executor, "executor", core.executor)
        again = llm.generate(prompts[:2], _params(2), use_tqdm=False)
        again += llm.generate(prompts[:1], _params(1), use_tqdm=False)  # its blocks were just computed
        aborted = _run_with_abort(llm.llm_engine, prompts[:6])
        return first, again, aborted, core.scheduler.num_preemptions, core.max_batches_in_flight, events
    finally:
        llm.llm_engine.shutdown()


class Recording:
    """The engine's executor, recording the order of its calls: ("launch", step, requests), ("sample", step),
    ("result", step, requests that sampled)."""

    def __init__(self, executor, events: list) -> None:
        self.executor, self.events = executor, events

    def __getattr__(self, name):
        return getattr(self.executor, name)

    def launch(self, so):
        self.events.append(("launch", so.step_id, set(so.num_scheduled_tokens)))
        return RecordedStep(self.executor.launch(so), so.step_id, self.events)


class RecordedStep:
    def __init__(self, future, step: int, events: list) -> None:
        self.future, self.step, self.events = future, step, events

    def sample(self) -> None:
        self.events.append(("sample", self.step))
        self.future.sample()

    def result(self):
        out = self.future.result()
        self.events.append(("result", self.step, set(out.sampled_token_ids)))
        return out


def _overlap(events: list) -> tuple[int, int, int]:
    """Per request that a step sampled and that runs again: whether its next step was launched before the engine
    took the step's tokens. Returns (how many were, how many were not, how many were launched before the step's
    sampling was queued: the true dependency broken)."""
    at = {(e[0], e[1]): i for i, e in enumerate(events)}
    launches = [(i, e[1], e[2]) for i, e in enumerate(events) if e[0] == "launch"]
    before = after = broken = 0
    for i, e in enumerate(events):
        if e[0] != "result":
            continue
        for req in e[2]:
            nxt = next((j for j, step, reqs in launches if step > e[1] and req in reqs), None)
            if nxt is None:
                continue
            before, after = before + (nxt < i), after + (nxt > i)
            broken += nxt < at.get(("sample", e[1]), i)  # (none: sampled as its result was taken)
    return before, after, broken


def _run_with_abort(engine, prompts: list[dict]):
    """Runs the prompts (greedy); with steps in flight, aborts a request of the newest one after three steps.
    Returns (the finished outputs by id, the aborted id, whether the scheduler held its end until its step was
    done)."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    finished, aborted, held = {}, None, False
    for step in range(200):
        queue = engine.core.batch_queue
        if step >= 3 and aborted is None and queue and queue[-1][0].num_scheduled_tokens:
            aborted = next(iter(queue[-1][0].num_scheduled_tokens))
            engine.abort_request(aborted)
            held = aborted in engine.core.scheduler.ended_in_flight
        for out in engine.step():
            finished[out.request_id] = out.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            break
    return finished, aborted, held


def _summary(outs) -> list:
    rows = []
    for out in outs:
        for c in out.outputs:
            lps = [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)] if c.logprobs else []
            rows.append((c.token_ids, lps))
        for entry in (out.prompt_logprobs or [])[1:]:
            rows.append((sorted(entry), [entry[t].logprob for t in sorted(entry)]))
    return rows


def _assert_same(a, b) -> None:
    for (ta, la), (tb, lb) in zip(_summary(a), _summary(b), strict=True):
        assert ta == tb
        np.testing.assert_allclose(la, lb, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def one_process(llama_path):
    return _run(llama_path, (1, 1))


@pytest.mark.parametrize("layout", [(1, 2), pytest.param((2, 2), marks=pytest.mark.slow)], ids=str)
def test_batches_in_flight_equal_one_process(layout, llama_path, one_process):
    first, again, (finished, aborted, held), preemptions, max_in_flight, events = _run(llama_path, layout)
    ref_first, ref_again, (ref_finished, _, _), _, _, _ = one_process
    _assert_same(ref_first, first)
    _assert_same(ref_again, again)
    assert max_in_flight == layout[1], "the stages never had as many batches in flight as there are stages"
    assert preemptions > 0, "no request was preempted"
    assert again[-1].num_cached_tokens >= 4, "the repeated prompt found no cached block"
    assert held, "the aborted request had no step in flight"
    assert aborted not in finished and finished == {k: v for k, v in ref_finished.items() if k != aborted}
    before, after, broken = _overlap(events)
    assert broken == 0, "a step was launched before the sampling of its input tokens was queued"
    assert before > 2 * after, f"{before} next steps launched before their input tokens came back, {after} after"
