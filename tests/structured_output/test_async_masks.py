"""Structured outputs with async scheduling: a constrained request is scheduled on its placeholder (its last token
still on the device) like any request; its step's masks are filled once the previous step's tokens are in, from the
grammars that took them, and only then is the step's sampling queued. The outputs are those of synchronous
scheduling token for token (greedy and seeded, mixed with unconstrained rows, requests ending at different steps and
by grammar termination), every step is a full one (no empty alternate steps), and no mask is filled while the
grammars take a step's tokens."""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest
from char_tokenizer import EOS_ID

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.structured_output import manager

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    },
    "required": ["name", "xs"],
}
PROMPTS = ["hello", "{", "The answer is", "abc def", "x", "numbers: 1, 2, 3", "yes or no?", "q"]


def constrained(sampling: dict, **constraint) -> SamplingParams:
    return SamplingParams(**sampling, structured_outputs=StructuredOutputsParams(**constraint))


@pytest.fixture(scope="module")
def async_llm(tiny_char_model):
    llm = LLM(tiny_char_model, dtype="float32", kv_cache_memory_bytes=8 << 20, async_scheduling=True)
    assert llm.llm_engine.core.async_steps
    return llm


def summary(outs) -> list:
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for o in outs for c in o.outputs]


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.9, seed=4)], ids=["greedy", "seeded"])
def test_all_constrained_rows_match_synchronous_scheduling(tiny_llm, async_llm, sampling):
    params = constrained(sampling | {"max_tokens": 80, "n": 2}, json=SCHEMA, disable_any_whitespace=True)
    expected = tiny_llm.generate(PROMPTS, params, use_tqdm=False)
    got = async_llm.generate(PROMPTS, params, use_tqdm=False)
    assert summary(got) == summary(expected)
    for c in (c for o in got for c in o.outputs):
        assert c.finish_reason == "stop" and c.token_ids[-1] == EOS_ID
        jsonschema.validate(json.loads(c.text), SCHEMA)


def mixed_params() -> list[SamplingParams]:
    return [
        constrained({"temperature": 0.8, "seed": 1, "max_tokens": 80}, json=SCHEMA, disable_any_whitespace=True),
        constrained({"temperature": 0, "max_tokens": 60, "logprobs": 2}, regex=r"[a-z]{3,8}\.[0-9]"),
        SamplingParams(temperature=0, max_tokens=7),
        constrained({"temperature": 0.7, "seed": 2, "n": 3, "max_tokens": 20}, choice=["alpha", "beta", "gamma"]),
        constrained({"temperature": 0, "ignore_eos": True, "max_tokens": 20}, choice=["ab", "abcd"]),
        SamplingParams(temperature=0.9, seed=5, max_tokens=23, logprobs=1),
        constrained({"temperature": 0, "max_tokens": 5}, regex=r"[0-9]{10}"),  # cut by max_tokens
        constrained({"temperature": 0.5, "seed": 8, "stop": ["b"], "max_tokens": 30}, regex=r"(ab|ba){1,6}"),
    ]


def test_mixed_batch_matches_synchronous_scheduling(tiny_llm, async_llm):
    """Constrained and unconstrained rows that end at different steps: by EOS, max_tokens, a stop string, and a
    grammar that terminates (ignore_eos: the grammar takes its EOS, then ends the request)."""
    params = mixed_params()
    expected = tiny_llm.generate(PROMPTS, params, use_tqdm=False)
    got = async_llm.generate(PROMPTS, params, use_tqdm=False)
    assert summary(got) == summary(expected)
    for eo, go in zip(expected, got):
        for ec, gc in zip(eo.outputs, go.outputs):
            assert (ec.logprobs is None) == (gc.logprobs is None)
            if gc.logprobs is not None:
                assert [sorted(d) for d in gc.logprobs] == [sorted(d) for d in ec.logprobs]
    reasons = [c.finish_reason for o in got for c in o.outputs]
    assert {"stop", "length"} <= set(reasons)
    jsonschema.validate(json.loads(got[0].outputs[0].text), SCHEMA)
    assert re.fullmatch(r"[a-z]{3,8}\.[0-9]", got[1].outputs[0].text)
    assert all(c.text in ("alpha", "beta", "gamma") for c in got[3].outputs)
    terminated = got[4].outputs[0]  # its grammar's end, with EOS kept as the last token
    assert terminated.finish_reason == "stop" and terminated.token_ids[-1] == EOS_ID
    assert got[6].outputs[0].finish_reason == "length" and re.fullmatch("[0-9]{5}", got[6].outputs[0].text)


def test_preemption_and_chunked_prefill_with_async_constrained_rows(tiny_llm, tiny_char_model):
    """A small cache and token budget: requests on their placeholders are preempted (their token dropped, their
    grammar left where it was) and prompts are chunked; the outputs stay those of synchronous scheduling."""
    kwargs = dict(num_gpu_blocks_override=40, block_size=4, max_num_batched_tokens=16, enable_prefix_caching=True)
    llm = LLM(tiny_char_model, dtype="float32", async_scheduling=True, **kwargs)
    params = mixed_params()
    prompts = [p + " and some more words" for p in PROMPTS]
    expected = summary(tiny_llm.generate(prompts, params, use_tqdm=False))
    for _ in range(2):  # the second time from the prefix cache
        assert summary(llm.generate(prompts, params, use_tqdm=False)) == expected
    assert llm.llm_engine.core.scheduler.num_preemptions > 0


def test_constrained_rows_take_every_step(async_llm, monkeypatch):
    """8 constrained rows of 12 tokens and EOS: a step schedules all of them every time (13 steps and one that
    computes the dropped token after EOS), not every other step with an empty step between."""
    scheduler = async_llm.llm_engine.core.scheduler
    scheduled, schedule = [], scheduler.schedule

    def counted():
        so = schedule()
        scheduled.append(len(so.num_scheduled_tokens))
        return so

    params = constrained({"temperature": 0.8, "seed": 3, "max_tokens": 100}, regex="[a-c]{12}")
    async_llm.generate(PROMPTS[:1], params, use_tqdm=False)  # compiled (cached): no step waits for it
    monkeypatch.setattr(scheduler, "schedule", counted)
    outs = async_llm.generate(PROMPTS, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 13 and o.outputs[0].finish_reason == "stop" for o in outs)
    assert scheduled == [8] * 14, scheduled


def test_masks_never_filled_while_the_grammars_take_tokens(async_llm, monkeypatch):
    """A slow fill on the filler's thread: no grammar takes a token while a fill runs (the masks of a step are those
    of the grammars after the previous step's tokens, and the matchers are never used by two threads at once)."""
    filling, overlaps = threading.Event(), []
    fill, accept = manager.fill_bitmasks, manager.RequestGrammar.accept

    def slow_fill(*args):
        filling.set()
        try:
            time.sleep(0.002)
            return fill(*args)
        finally:
            filling.clear()

    def checked_accept(self, token_ids):
        overlaps.append(filling.is_set())
        return accept(self, token_ids)

    monkeypatch.setattr(manager, "fill_bitmasks", slow_fill)
    monkeypatch.setattr(manager.RequestGrammar, "accept", checked_accept)
    params = constrained({"temperature": 0.8, "seed": 6, "max_tokens": 60}, json=SCHEMA, disable_any_whitespace=True)
    outs = async_llm.generate(PROMPTS[:4], params, use_tqdm=False)
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    assert overlaps and not any(overlaps)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)], ids=["tp2", "pp2"])
def test_parallel_ranks_with_async_constrained_rows(tiny_llm, tiny_char_model, layout):
    """Tensor parallelism (the driver samples after the previous step's update, its peers join its logits' gather)
    and pipeline stages (a constrained request waits for its token) keep the outputs of one synchronous process."""
    params = [
        constrained({"temperature": 0.8, "seed": i, "max_tokens": 30}, regex=r"[a-c]{3,9}\.[0-9]") for i in range(3)
    ] + [SamplingParams(temperature=0, max_tokens=12)]
    expected = tiny_llm.generate(PROMPTS[:4], params, use_tqdm=False)
    llm = LLM(tiny_char_model, dtype="float32", kv_cache_memory_bytes=8 << 20, async_scheduling=True, **layout)
    try:
        assert summary(llm.generate(PROMPTS[:4], params, use_tqdm=False)) == summary(expected)
    finally:
        llm.llm_engine.shutdown()
