"""The model runner alone (no LLM, no scheduler): built from the EngineConfig of a tiny model and fed
SchedulerOutputs by hand. HF transformers' logits are the oracle for its tokens and logprobs; hand-made allowed-token
bitmasks constrain some rows."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from tiny_models import TINY_DECODER

from pagedllm.engine.request import Request
from pagedllm.engine.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

VOCAB = TINY_DECODER["vocab_size"]  # 320: ten words per mask
BLOCK = 4
BLOCKS_PER_REQ = 16  # 64 tokens


class Steps:
    """Feeds a runner SchedulerOutputs by hand: requests join with all their blocks and their whole prompt, then
    decode one token a step."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner, self.num_tokens, self.num_joined = runner, {}, 0

    def join(self, reqs: dict[str, tuple[list[int], SamplingParams]], masks=None) -> dict:
        new = []
        for req_id, (prompt, params) in reqs.items():
            blocks = list(range(self.num_joined * BLOCKS_PER_REQ, (self.num_joined + 1) * BLOCKS_PER_REQ))
            processors = req_id in self.runner.logits_processors  # (the scheduler says so from the request)
            new.append(
                NewRequestData(req_id, prompt, len(prompt), params, blocks, 0, [], has_logits_processors=processors)
            )
            self.num_tokens[req_id] = len(prompt)
            self.num_joined += 1
        so = SchedulerOutput(new, [], {r: len(p) for r, (p, _) in reqs.items()}, 0, grammar_bitmask=masks or {})
        return self._run(so)

    def decode(self, masks=None) -> dict:
        cached = [CachedRequestData(r, [], n - 1) for r, n in self.num_tokens.items()]  # the newest not computed
        so = SchedulerOutput([], cached, dict.fromkeys(self.num_tokens, 1), 0, grammar_bitmask=masks or {})
        return self._run(so)

    def _run(self, so: SchedulerOutput):
        so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
        out = self.runner.execute_model(so)
        for req_id, tokens in out.sampled_token_ids.items():
            self.num_tokens[req_id] += len(tokens)
        return out


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    """The HF model's last-position logits [vocab] float64."""
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -1].double()


def pack(allowed: np.ndarray) -> np.ndarray:
    """[vocab] bool -> the packed int32 mask [ceil(vocab / 32)]: bit j of word w allows token 32 * w + j."""
    words = -(-len(allowed) // 32)
    bits = np.zeros(words * 32, dtype=np.uint64)
    bits[: len(allowed)] = allowed
    return (bits.reshape(words, 32) << np.arange(32, dtype=np.uint64)).sum(axis=1).astype(np.uint32).view(np.int32)


PROMPTS = {"a": [5, 17, 99, 3, 250, 41], "b": [7, 7, 300, 12], "c": [1, 2, 3, 4, 5, 6, 7, 8, 9]}


def test_greedy_tokens_are_hf_argmax(tiny, runner):
    hf, _ = tiny
    steps = Steps(runner)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    outs = [steps.join({r: (p, greedy) for r, p in PROMPTS.items()})] + [steps.decode() for _ in range(3)]
    for req_id, prompt in PROMPTS.items():
        tokens = list(prompt)
        for out in outs:
            assert out.sampled_token_ids[req_id] == [int(hf_logits(hf, tokens).argmax())]
            tokens += out.sampled_token_ids[req_id]


def test_bitmask_constrains_greedy_and_sampled_rows_and_leaves_others(tiny, runner):
    hf, _ = tiny
    rng = np.random.default_rng(0)
    steps = Steps(runner)
    a_logits, c_logits = hf_logits(hf, PROMPTS["a"]), hf_logits(hf, PROMPTS["c"])
    allowed_a = rng.random(VOCAB) < 0.3
    allowed_a[int(a_logits.argmax())] = False  # the unconstrained choice is banned
    allowed_b = np.zeros(VOCAB, dtype=bool)
    allowed_b[[3, 200, 319]] = True  # the last word's last token included
    params = {
        "a": SamplingParams(temperature=0, logprobs=2),
        "b": SamplingParams(temperature=1.0, seed=4),
        "c": SamplingParams(temperature=0, logprobs=1),  # no mask
    }
    out = steps.join({r: (PROMPTS[r], params[r]) for r in PROMPTS}, {"a": pack(allowed_a), "b": pack(allowed_b)})
    masked_a = a_logits.masked_fill(torch.from_numpy(~allowed_a), float("-inf"))
    assert out.sampled_token_ids["a"] == [int(masked_a.argmax())]
    assert out.sampled_token_ids["b"][0] in (3, 200, 319)
    assert out.sampled_token_ids["c"] == [int(c_logits.argmax())]
    # logprobs of the masked logits (as vLLM reads them): renormalized over the allowed tokens
    ((ids, lps, ranks),) = out.logprobs["a"]
    ref = masked_a.log_softmax(-1)
    assert ids[0] == int(masked_a.argmax()) and ranks[0] == 1
    assert lps == pytest.approx(ref[ids].tolist(), abs=1e-4)
    assert ids[1:] == masked_a.topk(2).indices.tolist()
    ((c_ids, c_lps, _),) = out.logprobs["c"]  # the unmasked row: the raw logits
    assert c_lps == pytest.approx(c_logits.log_softmax(-1)[c_ids].tolist(), abs=1e-4)


def test_bitmask_of_one_token_forces_it_every_step(runner):
    steps = Steps(runner)
    only = {t: pack(np.arange(VOCAB) == t) for t in (0, 31, 32, 319)}
    params = SamplingParams(temperature=1.3, top_p=0.9)
    out = steps.join({"a": (PROMPTS["a"], params), "b": (PROMPTS["b"], params)}, {"a": only[0], "b": only[319]})
    assert out.sampled_token_ids == {"a": [0], "b": [319]}
    for t in (31, 32):
        assert steps.decode({"a": only[t], "b": only[t]}).sampled_token_ids == {"a": [t], "b": [t]}


def test_a_short_mask_keeps_the_tokens_past_it(tiny, runner):
    """A mask of fewer words than the vocabulary needs constrains only the tokens it covers."""
    hf, _ = tiny
    logits = hf_logits(hf, PROMPTS["c"])
    steps = Steps(runner)
    none_allowed = np.zeros(2, dtype=np.int32)  # tokens 0-63 banned, 64 on as they are
    out = steps.join({"c": (PROMPTS["c"], SamplingParams(temperature=0))}, {"c": none_allowed})
    assert out.sampled_token_ids["c"] == [64 + int(logits[64:].argmax())]


def test_logits_processors_come_from_the_runners_table(tiny, runner):
    """The message carries no callables: the runner applies those registered for the request id."""
    steps = Steps(runner)

    def force_9(output_ids, logits):
        logits[:] = float("-inf")
        logits[9] = 0.0
        return logits

    runner.register_logits_processors("a", [force_9])
    params = SamplingParams(temperature=0)
    out = steps.join({"a": (PROMPTS["a"], params), "b": (PROMPTS["b"], params)})
    assert out.sampled_token_ids == {"a": [9], "b": [int(hf_logits(tiny[0], PROMPTS["b"]).argmax())]}
    assert steps.decode().sampled_token_ids["a"] == [9]


def test_scheduler_output_is_plain_data(config):
    """What the scheduler sends pickles (no Request objects, no callables) and round-trips."""
    scheduler = Scheduler(config.scheduler, config.cache, 32)
    params = SamplingParams(max_tokens=4, logits_processors=[lambda ids, logits: logits])
    scheduler.add_request(Request("x", [1, 2, 3], params, None, 4))
    so = scheduler.schedule()
    so.grammar_bitmask = {"x": pack(np.arange(VOCAB) < 40)}
    back = pickle.loads(pickle.dumps(so))
    assert back.num_scheduled_tokens == {"x": 3} and back.new_reqs[0].token_ids == [1, 2, 3]
    assert back.new_reqs[0].sampling_params.logits_processors is None
    assert back.new_reqs[0].sampling_params.max_tokens == 4
    assert np.array_equal(back.grammar_bitmask["x"], so.grammar_bitmask["x"])
    assert params.logits_processors is not None  # the request's own parameters keep them
