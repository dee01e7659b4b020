"""Speculative decoding through EngineCore and the OutputProcessor, with a fake model (no LLM): outputs with drafts
from a replaying proposer (some corrupted) are identical to outputs without drafts, with stop strings, stop tokens,
EOS, max_tokens, logprobs, prefix caching, preemption and n > 1.

The fake model reads its context from a simulated paged KV cache (slot -> (position, token)), written through the
block tables the scheduler hands out: a rejected draft whose slot is not computed again, or a cached block holding
other tokens, changes the next token. It verifies drafts as the model runner does: the target token at the last
known position and at each draft position, drafts accepted while they equal it, then the first other one."""

from __future__ import annotations

import pytest

from pagedllm.config import (
    CacheConfig,
    CompilationConfig,
    DeviceConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pagedllm.engine.core import EngineCore
from pagedllm.engine.output_processor import OutputProcessor, RequestState, SequenceState
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode import ReplayProposer
from pagedllm.worker.scheduler_output import ModelRunnerOutput, SchedulerOutput

VOCAB, EOS, BS = 40, 0, 4


def next_token(context: list[int], params: SamplingParams) -> int:
    """The fake model's choice after context: greedy is a hash of the context's end; a sampled row mixes in its
    seed and position, as a seeded draw does."""
    h = context[-1] * 31 + (context[-2] if len(context) > 1 else 5) * 17 + len(context) * 3
    if params.temperature > 0:
        h = hash((params.seed, len(context), h))
    return h % VOCAB


def logprob_entry(context: list[int], token: int, k: int) -> tuple[list[int], list[float], list[int]]:
    lp = -((sum(context) + token) % 97) / 10
    ids = [token] + [(token + 1 + i) % VOCAB for i in range(k)]
    return ids, [lp - i for i in range(k + 1)], list(range(1, k + 2))


class FakeRunner:
    """The model runner's contract over a simulated KV cache."""

    def __init__(self) -> None:
        self.slots: list[tuple[int, int] | None] = []
        self.reqs: dict[str, dict] = {}

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.slots = [None] * (num_blocks * BS)

    def _slot(self, req: dict, position: int) -> int:
        return req["blocks"][position // BS] * BS + position % BS

    def _context(self, req: dict, length: int) -> list[int]:
        entries = [self.slots[self._slot(req, p)] for p in range(length)]
        assert all(e is not None and e[0] == p for p, e in enumerate(entries)), "a context slot was never written"
        return [token for _, token in entries]

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.reqs.pop(req_id, None)
        for new in so.new_reqs:
            self.reqs[new.req_id] = {
                "tokens": list(new.token_ids),
                "blocks": list(new.block_ids),
                "computed": new.num_computed_tokens,
                "params": new.sampling_params,
            }
        for cached in so.cached_reqs:
            self.reqs[cached.req_id]["blocks"] += cached.new_block_ids
            self.reqs[cached.req_id]["computed"] = cached.num_computed_tokens
        sampled, logprobs = {}, {}
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.reqs[req_id]
            drafts = so.scheduled_spec_decode_tokens.get(req_id, [])
            start, known = req["computed"], len(req["tokens"])
            inputs = req["tokens"][start : start + n - len(drafts)] + drafts
            assert len(inputs) == n and (not drafts or start + n - len(drafts) == known)
            for j, token in enumerate(inputs):
                self.slots[self._slot(req, start + j)] = (start + j, token)
            if start + n - len(drafts) < known:
                continue  # a prefill chunk: nothing sampled
            emitted, entries = [], []
            for i in range(len(drafts) + 1):
                context = self._context(req, known + i)
                target = next_token(context, req["params"])
                emitted.append(target)
                if req["params"].logprobs is not None:
                    entries.append(logprob_entry(context, target, req["params"].logprobs))
                if i == len(drafts) or drafts[i] != target:
                    break
            req["tokens"] += emitted
            sampled[req_id] = emitted
            if entries:
                logprobs[req_id] = entries
        return ModelRunnerOutput(sampled, logprobs)


class LetterTokenizer:
    """Token t is one letter: the text of the outputs is easy to search for stop strings."""

    def decode(self, ids, skip_special_tokens=True, spaces_between_special_tokens=True) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids)


def make_config(proposer, num_blocks: int, budget: int, caching: bool) -> EngineConfig:
    return EngineConfig(
        model=None,
        cache=CacheConfig(block_size=BS, num_gpu_blocks_override=num_blocks, enable_prefix_caching=caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8),
        parallel=ParallelConfig(),
        device=DeviceConfig(),
        compilation=CompilationConfig(),
        speculative_proposer=proposer,
    )


def generate(prompts, params: SamplingParams, proposer=None, num_blocks=64, budget=32, caching=False):
    """Runs the requests to the end as LLMEngine does; returns (outputs in prompt order, the core)."""
    core = EngineCore(make_config(proposer, num_blocks, budget, caching), FakeRunner())
    processor = OutputProcessor(LetterTokenizer())
    for i, prompt in enumerate(prompts):
        seqs, requests = {}, []
        for j in range(params.n):
            seq_params = params.clone()
            seq_params.seed = None if params.seed is None else params.seed + j
            seq_id = f"{i}_{j}"
            requests.append(Request(seq_id, prompt, seq_params, EOS, params.max_tokens))
            seqs[seq_id] = SequenceState(j, prompt, seq_params, processor.tokenizer, params.logprobs is not None)
        for req in requests:
            core.add_request(req)
        processor.add_request(RequestState(str(i), None, prompt, params.n, seqs))
    outputs, steps = {}, 0
    core.num_multi_token_outputs = 0  # outputs of several tokens: accepted drafts
    while core.has_unfinished_requests():
        step_outputs = core.step()
        core.num_multi_token_outputs += sum(len(o.new_token_ids) > 1 for o in step_outputs)
        finished, stop_ids = processor.process(step_outputs)
        if stop_ids:
            core.abort_requests(stop_ids, RequestStatus.FINISHED_STOPPED)
        outputs.update({o.request_id: o for o in finished})
        steps += 1
        assert steps < 500
    return [outputs[str(i)] for i in range(len(prompts))], core


def summary(outputs) -> list:
    return [
        (c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs, c.cumulative_logprob)
        for o in outputs
        for c in o.outputs
    ]


PROMPTS = [[3, 7, 11, 2, 9], [5, 5, 6], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [30, 31], [8, 1]]
CASES = {
    "greedy": dict(params=SamplingParams(temperature=0, max_tokens=14)),
    "greedy, logprobs": dict(params=SamplingParams(temperature=0, max_tokens=14, logprobs=2)),
    "ignore_eos, max_tokens": dict(params=SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)),
    "n=3 seeded": dict(params=SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12, logprobs=1)),
    "prefix caching, chunked": dict(params=SamplingParams(temperature=0, max_tokens=14), caching=True, budget=6),
    "preemption": dict(params=SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), num_blocks=14),
    "preemption, caching": dict(
        params=SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), num_blocks=14, caching=True
    ),
}


def proposer_for(outputs, prompts, corrupt_every: int) -> ReplayProposer:
    recorded = [prompts[int(o.request_id)] + c.token_ids for o in outputs for c in o.outputs]
    return ReplayProposer(recorded, num_drafts=4, vocab_size=VOCAB, corrupt_every=corrupt_every, seed=1)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("corrupt_every", [0, 3])
def test_outputs_with_drafts_equal_outputs_without(case, corrupt_every):
    kwargs = CASES[case]
    prompts = PROMPTS + [PROMPTS[2] + [12, 13]] if kwargs.get("caching") else PROMPTS  # a shared prefix
    reference, ref_core = generate(prompts, **kwargs)
    proposer = proposer_for(reference, prompts, corrupt_every)
    outputs, core = generate(prompts, proposer=proposer, **kwargs)
    assert summary(outputs) == summary(reference)
    assert proposer.num_proposed > 0 and core.num_multi_token_outputs > 0  # drafts were accepted
    sched = core.scheduler
    assert 0 < sched.num_accepted_tokens <= sched.num_draft_tokens <= proposer.num_proposed
    if corrupt_every == 0 and kwargs["params"].temperature == 0:
        assert sched.num_accepted_tokens == sched.num_draft_tokens  # the true continuation: every draft accepted
    if "preemption" in case:
        assert core.scheduler.num_preemptions > 0 and ref_core.scheduler.num_preemptions > 0
    if kwargs.get("caching"):
        assert core.scheduler.kv.num_hits > 0
    assert core.scheduler.kv.pool.num_free_blocks == core.scheduler.kv.pool.num_blocks


def test_the_reference_run_meets_eos_and_max_tokens():
    """The greedy cases above end both ways (EOS inside an accepted list, and the length)."""
    reference, _ = generate(PROMPTS, SamplingParams(temperature=0, max_tokens=14))
    reasons = {c.finish_reason for o in reference for c in o.outputs}
    assert reasons == {"stop", "length"}


@pytest.mark.parametrize("by", ["stop string", "stop token"])
def test_a_stop_inside_the_accepted_drafts_ends_the_output_there(by):
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=1)
    reference, _ = generate(PROMPTS, params)
    proposer = proposer_for(reference, PROMPTS, corrupt_every=0)  # whole runs of drafts accepted
    long = next(c for o in reference for c in o.outputs if len(c.token_ids) == 14)
    stop_params = params.clone()
    if by == "stop string":
        stop_params.stop = [long.text[6:8]]  # found at the 7th or an earlier output
    else:
        stop_params.stop_token_ids = [long.token_ids[6]]
    expected, _ = generate(PROMPTS, stop_params)
    outputs, core = generate(PROMPTS, stop_params, proposer=proposer)
    assert summary(outputs) == summary(expected)
    stopped = [c for o in outputs for c in o.outputs if c.finish_reason == "stop"]
    assert stopped and all(len(c.token_ids) < 14 for c in stopped)
    assert all(len(c.logprobs) == len(c.token_ids) for c in stopped)


def test_a_proposer_that_is_always_wrong_changes_nothing():
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=1)
    reference, _ = generate(PROMPTS, params)
    wrong = ReplayProposer([], num_drafts=3, vocab_size=VOCAB)  # proposes the last token again
    outputs, core = generate(PROMPTS, params, proposer=wrong)
    assert summary(outputs) == summary(reference) and wrong.num_proposed > 0
