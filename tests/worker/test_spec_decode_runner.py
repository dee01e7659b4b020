"""The model runner verifying drafts (no LLM, no scheduler): SchedulerOutputs with scheduled_spec_decode_tokens fed by
hand to a tiny model. HF transformers' logits are the oracle: the runner emits the drafts that equal the argmax at
their positions, then the argmax where the first one differs; the KV of rejected drafts is written over later."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

BLOCK, BLOCKS_PER_REQ = 4, 16


def hf_greedy(hf, tokens: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """HF's greedy continuation of n tokens and the log-softmax at each step."""
    tokens, out, lps = list(tokens), [], []
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([tokens])).logits[0, -1].double()
            out.append(int(logits.argmax()))
            lps.append(logits.log_softmax(-1))
            tokens.append(out[-1])
    return out, lps


class Requests:
    """One request per id in its own blocks; each step schedules its newest token (+ drafts) as the scheduler
    would, rolling num_computed back to the accepted length."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner, self.tokens, self.computed, self.joined = runner, {}, {}, 0

    def join(self, prompts: dict[str, list[int]], params: SamplingParams):
        new = []
        for req_id, prompt in prompts.items():
            blocks = list(range(self.joined * BLOCKS_PER_REQ, (self.joined + 1) * BLOCKS_PER_REQ))
            self.joined += 1
            new.append(NewRequestData(req_id, list(prompt), len(prompt), params, blocks, 0, []))
            self.tokens[req_id], self.computed[req_id] = list(prompt), 0
        return self._run(new, [], {r: len(p) for r, p in prompts.items()}, {})

    def step(self, drafts: dict[str, list[int]]):
        cached = [CachedRequestData(r, [], self.computed[r]) for r in self.tokens]
        num = {r: len(self.tokens[r]) - self.computed[r] + len(drafts.get(r, [])) for r in self.tokens}
        return self._run([], cached, num, {r: d for r, d in drafts.items() if d})

    def _run(self, new, cached, num, spec):
        so = SchedulerOutput(new, cached, num, sum(num.values()), scheduled_spec_decode_tokens=spec)
        out = self.runner.execute_model(so)
        for req_id, emitted in out.sampled_token_ids.items():
            assert 1 <= len(emitted) <= len(spec.get(req_id, [])) + 1
            self.computed[req_id] = len(self.tokens[req_id]) + len(emitted) - 1  # rejected drafts: computed again
            self.tokens[req_id] += emitted
        return out


PROMPTS = {"a": [5, 17, 99, 3, 250, 41], "b": [7, 7, 300, 12]}


def test_drafts_equal_to_the_argmax_are_accepted_and_the_first_other_is_replaced(tiny, runner):
    hf, _ = tiny
    truth = {r: hf_greedy(hf, p, 16) for r, p in PROMPTS.items()}
    reqs = Requests(runner)
    greedy = SamplingParams(temperature=0, max_tokens=20, logprobs=2)
    out = reqs.join(PROMPTS, greedy)
    assert out.sampled_token_ids == {r: truth[r][0][:1] for r in PROMPTS}
    a, b = truth["a"][0], truth["b"][0]
    # a: three right drafts (all accepted, plus the argmax after them); b: right, wrong, right (1 accepted)
    out = reqs.step({"a": a[1:4], "b": [b[1], (b[2] + 1) % 320, b[3]]})
    assert out.sampled_token_ids == {"a": a[1:5], "b": b[1:3]}
    for req_id, n in (("a", 4), ("b", 2)):
        entries = out.logprobs[req_id]
        assert len(entries) == n
        for (ids, lps, ranks), ref in zip(entries, truth[req_id][1][1 : 1 + n]):
            assert ranks[0] == 1 and ids[1:] == ref.topk(2).indices.tolist()
            assert lps == pytest.approx(ref[ids].tolist(), abs=1e-4)
    # a: every draft wrong (1 token); b: none; then both go on from what they emitted, over rewritten slots
    out = reqs.step({"a": [(a[5] + 1) % 320, a[6]]})
    assert out.sampled_token_ids == {"a": a[5:6], "b": b[3:4]}
    for _ in range(3):
        out = reqs.step({r: truth[r][0][len(reqs.tokens[r]) - len(PROMPTS[r]) :][:2] for r in PROMPTS})
    for req_id, prompt in PROMPTS.items():
        emitted = reqs.tokens[req_id][len(prompt) :]
        assert emitted == truth[req_id][0][: len(emitted)] and len(emitted) >= 9


def test_a_seeded_request_draws_the_same_tokens_with_drafts(runner):
    seeded = SamplingParams(temperature=1.0, seed=123, max_tokens=20)
    plain = Requests(runner)
    plain.join({"s1": PROMPTS["a"]}, seeded)
    for _ in range(8):
        plain.step({})
    reference = plain.tokens["s1"]
    spec = Requests(runner)  # (over the blocks of s1, which is done)
    spec.join({"s2": PROMPTS["a"]}, seeded)
    rng = np.random.default_rng(1)
    num_multi = 0
    while len(spec.tokens["s2"]) < len(reference):
        n = len(spec.tokens["s2"])
        drafts = reference[n : n + 3]
        drafts = [t if rng.random() < 0.7 else (t + 1) % 320 for t in drafts]  # some wrong
        num_multi += len(spec.step({"s2": drafts}).sampled_token_ids["s2"]) > 1
    assert spec.tokens["s2"][: len(reference)] == reference and num_multi > 0


@pytest.mark.parametrize("min_tokens, eos_at, num_emitted", [(4, 2, 2), (3, 3, 4)])
def test_min_tokens_holds_back_eos_by_each_draft_position(tiny, runner, min_tokens, eos_at, num_emitted):
    """Output eos_at + 1's argmax is taken as EOS; drafts for outputs 2-4 (the true continuation): EOS is banned
    (the draft rejected) while fewer than min_tokens outputs come before its position, and accepted from then on."""
    hf, _ = tiny
    truth, _ = hf_greedy(hf, PROMPTS["b"], 6)
    eos = truth[eos_at]
    assert eos not in truth[:eos_at]
    reqs = Requests(runner)
    params = SamplingParams(temperature=0, max_tokens=20, min_tokens=min_tokens)
    new = NewRequestData("m", list(PROMPTS["b"]), len(PROMPTS["b"]), params, list(range(BLOCKS_PER_REQ)), 0, [eos])
    reqs.tokens["m"], reqs.computed["m"] = list(PROMPTS["b"]), 0
    reqs._run([new], [], {"m": len(PROMPTS["b"])}, {})
    emitted = reqs.step({"m": truth[1:4]}).sampled_token_ids["m"]
    if num_emitted == 4:  # eos accepted as the draft for output 4, then the argmax after it
        assert emitted == truth[1:5]
    else:  # the draft eos rejected at output 3: the best other token there
        assert emitted[0] == truth[1] and len(emitted) == 2 and emitted[1] != eos
