"""The rule that turns drafts off (spec_decode/policy.py): disable_by_batch_size counts every decoding request, and
rows with poor running acceptance back off, then probe."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import transformers
from tiny_models import TINY_DECODER, save_tiny_decoder

from pagedllm import LLM, SamplingParams
from pagedllm.spec_decode import SpeculativeConfig
from pagedllm.spec_decode.policy import BACKOFF_STEPS, MIN_ACCEPTANCE, DraftPolicy


def req(req_id: str, decoding: bool = True, can_speculate: bool = True):
    num_tokens = 10
    return SimpleNamespace(
        request_id=req_id,
        num_tokens=num_tokens,
        num_computed_tokens=num_tokens - 1 if decoding else 3,
        can_speculate=can_speculate,
    )


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def test_batch_size_counts_every_decoding_request():
    policy = DraftPolicy(SpeculativeConfig("ngram", 2, disable_by_batch_size=2))
    a, b, c = req("a"), req("b", can_speculate=False), req("c", can_speculate=False)
    assert ids(policy.select([a, b])) == ["a"]  # 2 decode: drafts for the one that may speculate
    assert policy.select([a, b, c]) == []  # 3 decode (only one may speculate): more than 2, none
    assert ids(policy.select([a, b, req("p", decoding=False)])) == ["a"]  # a prefilling request does not count


def test_no_drafts_past_max_model_len():
    """speculative_max_model_len: a request whose tokens and K drafts would pass it gets none."""
    policy = DraftPolicy(SpeculativeConfig("ngram", 2, max_model_len=12))
    short, long = req("short"), req("long")
    long.num_tokens, long.num_computed_tokens = 11, 10  # 11 + 2 drafts > 12
    assert ids(policy.select([short, long])) == ["short"]  # 10 + 2 = 12: still fits
    assert ids(DraftPolicy(SpeculativeConfig("ngram", 2)).select([short, long])) == ["short", "long"]
    assert SpeculativeConfig.from_user(None, "[ngram]", 2, None, None, None, 12).max_model_len == 12


def test_poor_rows_back_off_then_probe():
    policy = DraftPolicy(SpeculativeConfig("ngram", 4))
    good, poor = req("good"), req("poor")
    steps = 0
    while ids(policy.select([good, poor])) == ["good", "poor"]:  # poor accepts nothing, good everything
        policy.record({"good": [1] * 4, "poor": [1] * 4}, {"good": [1] * 5, "poor": [2]})
        steps += 1
    # the running average 0.75^n falls below 1/8 at the 8th step
    assert steps == 8 and policy.rows["poor"].rate < MIN_ACCEPTANCE <= 0.75**7
    for _ in range(BACKOFF_STEPS - 1):  # BACKOFF_STEPS steps without drafts in all (the loop's last select is one)
        assert ids(policy.select([good, poor])) == ["good"]
    assert ids(policy.select([good, poor])) == ["good", "poor"]  # the probe
    policy.record({"poor": [1] * 4}, {"poor": [2]})  # fails: backs off again at once
    assert ids(policy.select([good, poor])) == ["good"]
    for _ in range(BACKOFF_STEPS - 1):
        policy.select([good, poor])
    assert ids(policy.select([good, poor])) == ["good", "poor"]
    policy.record({"poor": [1] * 4}, {"poor": [1, 1, 2]})  # half accepted: it keeps drafting
    assert ids(policy.select([good, poor])) == ["good", "poor"]
    assert policy.num_backed_off == 2


def test_rows_of_finished_requests_are_forgotten():
    policy = DraftPolicy(SpeculativeConfig("ngram", 2))
    policy.record({"a": [1, 1]}, {"a": [1, 1, 1]})
    policy.select([req("b")])
    assert "a" not in policy.rows


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return save_tiny_decoder(
        "llama", transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(TINY_DECODER), tmp_path_factory
    )[1]


def test_requests_that_may_not_speculate_count_toward_disable_by_batch_size(path):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 2}
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22, speculative_config=spec)
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    processed = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logits_processors=[lambda _, x: x])
    prompts = [{"prompt_token_ids": [5, 17, 33, 101, 7] * 6}, {"prompt_token_ids": [11, 12] * 12}] * 2
    sched = llm.llm_engine.core.scheduler
    llm.generate(prompts[:2], [plain, processed], use_tqdm=False)
    assert sched.num_draft_tokens > 0  # two decode: the plain one drafts
    before = sched.num_draft_tokens
    llm.generate(prompts[:3], [plain, processed, processed], use_tqdm=False)
    assert sched.num_draft_tokens == before  # three decode, one may speculate: none drafts


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_async_steps_above_disable_by_batch_size_synchronous_with_drafts_below(path, method):
    """With async scheduling, steps run asynchronously without drafts while more than disable_by_batch_size
    requests run, then synchronously with drafts: the outputs are those without speculation."""
    spec = {"method": method, "num_speculative_tokens": 3, "disable_by_batch_size": 2}
    spec |= {"model": path} if method == "draft_model" else {}
    llm = LLM(
        path, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22, block_size=4,
        speculative_config=spec, async_scheduling=True,
    )  # fmt: skip
    core = llm.llm_engine.core
    step_async, num_async = core._step_async, []
    core._step_async = lambda: num_async.append(1) or step_async()
    prompts = [{"prompt_token_ids": [5, 17, 33, 101, 7] * 6}, {"prompt_token_ids": [11, 12] * 12}] * 2
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (5, 9, 40, 40)]
    proposer = core.config.speculative_proposer
    core.config.speculative_proposer = None  # all steps asynchronous, no drafts
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    core.config.speculative_proposer = proposer
    assert core.scheduler.num_draft_tokens == 0
    num_async.clear()
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outputs == reference
    assert core.scheduler.num_accepted_tokens > 0  # drafts once two requests were left
    assert 5 <= len(num_async) < 20  # asynchronous steps while 3 or 4 requests ran
