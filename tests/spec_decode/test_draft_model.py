"""Draft-model speculative decoding end to end on a tiny random Llama target (float32, CPU): outputs with a draft
model are the outputs without speculation, token for token, over several batch compositions, with logprobs, prefix
caching, chunked prefill, preemption and seeded n > 1 sampling. A draft equal to the target has its drafts all
accepted (checked in the metrics); a different random draft (smaller, other KV shapes) has few accepted, and its rows
back off (spec_decode/policy.py), and the outputs are still exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from tiny_models import TINY_DECODER, save_tiny_decoder

from pagedllm import LLM, SamplingParams

K = 3
PROMPTS = [
    [5, 17, 33, 101, 7] * 6,
    list(range(40, 80)),
    [9, 8, 7],
    [200, 201, 202, 203, 150, 151, 200, 201],
    [11, 12] * 12,
    list(range(100, 140)),
]
BATCHES = {"one": [0], "three": [0, 1, 2], "six": [0, 1, 2, 3, 4, 5], "short first": [2, 5, 3]}
DRAFT = dict(TINY_DECODER, hidden_size=32, intermediate_size=48, num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """Peaked next-token distributions (output layer scaled up): seeded sampling follows the draft's greedy choice
    often enough for sampled drafts to be accepted."""
    hf, path = save_tiny_decoder(
        "spec-target", transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(TINY_DECODER), tmp_path_factory
    )
    with torch.no_grad():
        hf.lm_head.weight.mul_(20)
    hf.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    return save_tiny_decoder(
        "spec-draft", transformers.LlamaConfig, transformers.LlamaForCausalLM, DRAFT, tmp_path_factory
    )[1]


def make_llm(target: str, draft: str, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory_bytes", 1 << 22)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": K}
    return LLM(target, dtype="float32", skip_tokenizer_init=True, block_size=4, speculative_config=spec, **kwargs)


@pytest.fixture(scope="module")
def same(target):
    return make_llm(target, target)


@pytest.fixture(scope="module")
def other(target, other_draft):
    return make_llm(target, other_draft)


def run(llm: LLM, prompts, params, speculate: bool):
    """The outputs, with the engine's draft model or without speculation, and (drafts, accepted) verified."""
    config, sched = llm.llm_engine.config, llm.llm_engine.core.scheduler
    proposer, before = config.speculative_proposer, (sched.num_draft_tokens, sched.num_accepted_tokens)
    if not speculate:
        config.speculative_proposer = None
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        config.speculative_proposer = proposer
    return outputs, (sched.num_draft_tokens - before[0], sched.num_accepted_tokens - before[1])


def exact(outputs) -> list:
    return [(c.token_ids, c.finish_reason, [sorted(d) for d in c.logprobs or []]) for o in outputs for c in o.outputs]


def floats(outputs) -> list[float]:
    return [lp.logprob for o in outputs for c in o.outputs for d in c.logprobs or [] for lp in d.values()]


def assert_same_with_drafts(llm: LLM, prompts, params) -> tuple[int, int]:
    reference, none = run(llm, prompts, params, speculate=False)
    assert none == (0, 0)
    outputs, counts = run(llm, prompts, params, speculate=True)
    assert exact(outputs) == exact(reference)
    assert floats(outputs) == pytest.approx(floats(reference), abs=1e-4)
    assert counts[0] > 0  # drafts were proposed and verified
    return counts


GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)


@pytest.mark.parametrize("batch", BATCHES)
def test_draft_equal_to_target_is_exact_and_all_accepted(same, batch):
    num_drafts, num_accepted = assert_same_with_drafts(same, [PROMPTS[i] for i in BATCHES[batch]], GREEDY)
    assert num_accepted >= 0.95 * num_drafts  # the same model proposes the target's greedy tokens


def test_steady_state_first_pass_is_one_token_passes(same):
    """The draft's KV of its accepted drafts is kept: after the catch-up over a prompt, pass 1 only covers the
    sampled token (and the last draft when all were accepted)."""
    drafter = same.llm_engine.core.executor.runner.drafter
    before = dict(drafter.num_first_passes)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    num_drafts, num_accepted = assert_same_with_drafts(same, PROMPTS[:3], params)
    decode = drafter.num_first_passes["decode"] - before["decode"]
    catch_up = drafter.num_first_passes["catch_up"] - before["catch_up"]
    assert num_accepted >= 0.95 * num_drafts
    assert catch_up <= 3 and decode >= 10  # the prompts' catch-up (possibly together), then one-token passes


@pytest.mark.parametrize("batch", ["three", "six"])
def test_other_draft_is_exact_with_low_acceptance_and_backs_off(other, batch):
    policy = other.llm_engine.core.draft_policy
    backed_off = policy.num_backed_off
    num_drafts, num_accepted = assert_same_with_drafts(other, [PROMPTS[i] for i in BATCHES[batch]], GREEDY)
    assert num_accepted < 0.5 * num_drafts
    assert policy.num_backed_off > backed_off  # rows with poor acceptance stopped drafting
    steps = len(BATCHES[batch]) * (GREEDY.max_tokens - 1)
    assert num_drafts < 0.5 * K * steps  # far fewer drafts than K per decode step


def test_metrics_per_position(same):
    run(same, PROMPTS[:2], GREEDY, speculate=True)
    metrics = {m.name: getattr(m, "values", None) or m.value for m in same.get_metrics() if "spec_decode" in m.name}
    sched = same.llm_engine.core.scheduler
    drafts = metrics["vllm:spec_decode_num_draft_tokens"]
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"]
    assert drafts == sched.num_draft_tokens and accepted == sched.num_accepted_tokens
    assert accepted >= 0.95 * drafts > 0
    num_seqs = metrics["vllm:spec_decode_num_drafts"]
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert min(per_pos) >= 0.95 * num_seqs  # every position accepted (almost) every time


def test_prefix_caching(same):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    reference, _ = run(same, PROMPTS[:3], params, speculate=False)
    continued = [o.prompt_token_ids + o.outputs[0].token_ids for o in reference]  # prompts over cached blocks
    hits = same.llm_engine.core.scheduler.kv.num_hits
    num_drafts, num_accepted = assert_same_with_drafts(same, continued, params)
    assert same.llm_engine.core.scheduler.kv.num_hits > hits
    assert num_accepted >= 0.95 * num_drafts


def test_preemption_and_chunked_prefill(target):
    # 40 blocks of 4 tokens for 6 requests of up to 70 tokens: preemption; a 16-token budget: chunked prefill, and
    # the draft catches up on long prompts over several steps
    small = make_llm(target, target, num_gpu_blocks_override=40, max_num_batched_tokens=16, kv_cache_memory_bytes=None)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    num_drafts, num_accepted = assert_same_with_drafts(small, PROMPTS, params)
    assert small.llm_engine.core.scheduler.num_preemptions > 0
    assert num_accepted >= 0.95 * num_drafts


def test_seeded_sampling_n2_equals_no_speculation(same):
    params = SamplingParams(n=2, temperature=0.8, top_p=0.95, seed=7, max_tokens=24, ignore_eos=True, logprobs=1)
    num_drafts, num_accepted = assert_same_with_drafts(same, PROMPTS[:3], params)
    assert 0 < num_accepted < num_drafts  # sampled tokens sometimes leave the draft's greedy path


def test_kv_block_bytes_include_the_draft(same, target, other_draft):
    runner = same.llm_engine.core.executor.runner
    per_layer = 2 * 4 * 2 * 16 * 4  # block 4, 2 KV heads of 16 dims, float32
    assert runner.kv_bytes_per_block() == 2 * per_layer + 2 * per_layer  # target's 2 layers + the draft's 2
    assert runner.drafter.num_blocks == same.llm_engine.config.cache.num_blocks == (1 << 22) // (4 * per_layer)
    small = make_llm(target, other_draft).llm_engine.core.executor.runner
    assert small.kv_bytes_per_block() == 2 * per_layer + 2 * (2 * 4 * 1 * 16 * 4)  # draft: 1 KV head of 16 dims


def test_seed_era_keyword(target):
    llm = LLM(
        target, dtype="float32", skip_tokenizer_init=True, block_size=4, kv_cache_memory_bytes=1 << 22,
        speculative_model=target, num_speculative_tokens=2,
    )  # fmt: skip
    spec = llm.llm_engine.config.speculative_config
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("draft_model", target, 2)
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert llm.llm_engine.core.scheduler.num_draft_tokens > 0


def test_draft_with_another_vocabulary_is_refused(target, tmp_path_factory):
    _, path = save_tiny_decoder(
        "spec-vocab", transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(DRAFT, vocab_size=300),
        tmp_path_factory,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"vocab_size=300, the target model .* has 320: .* target's tokenizer"):
        make_llm(target, path)


class CountingEvent:
    """A graph runner's copy event off CUDA: counts the host's waits on it (each a stall on a GPU)."""

    def __init__(self) -> None:
        self.waits = 0

    def synchronize(self) -> None:
        self.waits += 1

    def record(self) -> None:
        pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter runs without a GPU only")
def test_draft_equal_to_target_through_static_buffers_accepts_its_drafts(target):
    """The draft's passes over the graph runners' static buffers, unforced: each replay rewrites the runner's output,
    so a pass's tokens must be kept apart from it (they were not: every draft became the last pass's token and a
    draft equal to the target had ~7% of its drafts accepted on a GPU)."""
    pytest.importorskip("triton")
    from static_graphs import make_static

    spec = {"method": "draft_model", "model": target, "num_speculative_tokens": 4}
    llm = LLM(target, dtype="float32", skip_tokenizer_init=True, block_size=4, speculative_config=spec)
    make_static(llm)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reference, _ = run(llm, PROMPTS[1:3], params, speculate=False)
    outputs, (num_drafts, num_accepted) = run(llm, PROMPTS[1:3], params, speculate=True)
    assert exact(outputs) == exact(reference)
    assert num_drafts > 0 and num_accepted >= 0.95 * num_drafts


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter runs without a GPU only")
def test_draft_passes_through_static_buffers_wait_on_the_host_at_most_twice(target):
    """The draft's passes over the graph runners' static buffers (LM head and argmax inside them): a proposal's
    host staging waits (one per load_inputs) are at most two, whatever K (passes 3..K load from the device); forced
    drafts are proposed and fed on; the outputs equal those without speculation."""
    pytest.importorskip("triton")
    from static_graphs import make_static

    k = 5
    spec = {"method": "draft_model", "model": target, "num_speculative_tokens": k}
    llm = LLM(target, dtype="float32", skip_tokenizer_init=True, block_size=4, speculative_config=spec)
    make_static(llm)
    drafter = llm.llm_engine.core.executor.runner.drafter
    drafter.graphs.copy_done, drafter.first_graphs.copy_done = CountingEvent(), CountingEvent()

    def force(histories):  # draft 2 forced to token 7 (draft 3 follows it), the others the draft model's
        out = np.full((len(histories), k), -1, dtype=np.int64)
        out[:, 1] = 7
        return out

    proposals, propose = [], drafter.propose

    def recorded(token_ids):
        proposals.append(propose(token_ids))
        return proposals[-1]

    drafter.propose, drafter.force_drafts = recorded, force
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = PROMPTS[1:3]
    reference, _ = run(llm, prompts, params, speculate=False)
    replays = drafter.graphs.num_replays
    outputs, (num_drafts, _) = run(llm, prompts, params, speculate=True)
    assert exact(outputs) == exact(reference) and num_drafts > 0
    drafts = [d for p in proposals if p for d in p.host().tolist()]  # (DeviceDrafts: the tokens on the device)
    assert drafts and all(len(d) == k and d[1] == 7 for d in drafts)
    waits = drafter.graphs.copy_done.waits + drafter.first_graphs.copy_done.waits
    assert 0 < waits <= 2 * len(proposals)  # (K per proposal when each pass staged its inputs on the host)
    assert drafter.graphs.num_replays - replays >= (k - 1) * sum(bool(p) for p in proposals)
    assert drafter.first_graphs.num_replays > 0


@pytest.mark.gpu
def test_gpu_verify_steps_and_draft_passes_replay_graphs(target):
    """On a GPU (float32): verify steps replay the target's verify graphs and the draft's first passes its graphs of
    K + 1 tokens per row (rows with fewer padded on the left); outputs equal those without speculation."""
    llm = make_llm(target, target)
    runner = llm.llm_engine.core.executor.runner
    assert runner.verify_graphs is not None and runner.verify_graphs.q_len == K + 1
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    prompts = [PROMPTS[i] for i in BATCHES["six"]]
    reference, _ = run(llm, prompts, params, speculate=False)
    verify, first = runner.verify_graphs.num_replays, runner.drafter.first_graphs.num_replays
    outputs, (num_drafts, num_accepted) = run(llm, prompts, params, speculate=True)
    assert exact(outputs) == exact(reference) and num_accepted >= 0.9 * num_drafts
    # the draft is the target: ~K + 1 tokens a step, so ~40 / 5 verify steps (on an H100: 11 verify replays and 8
    # first passes; a step right after the prefill catches up eagerly)
    assert runner.verify_graphs.num_replays > verify + 5 and runner.drafter.first_graphs.num_replays > first + 5
