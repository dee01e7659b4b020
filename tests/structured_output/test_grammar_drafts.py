"""Structured outputs with speculative decoding, end to end on the tiny character-level Llama (conftest.py): with
n-gram and draft-model speculation, constrained requests (JSON schema, regex, choice; xgrammar and llguidance) draft
too, each draft position verified under its own grammar mask, and their outputs are those without speculation token
for token (greedy, and seeded sampling, which draws each position by (seed, position)); every output is valid (the
jsonschema package, re.fullmatch, choice membership). Each case asserts from the spec-decode metrics that drafts
were proposed and accepted for the constrained rows (the engine runs nothing else)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
import transformers
from char_tokenizer import EOS_ID, MODEL_VOCAB, char_tokenizer

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.spec_decode.proposer import ReplayProposer

SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"k": {"const": "v"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["k", "n"],
    },
    "minItems": 1,
    "maxItems": 3,
}
REGEX = r"(abc|[0-9], ){2,8}"
CHOICES = ["abcabcabc", "abcab", "1, 2, 1, 2", "{}"]
CONSTRAINTS = {
    "json": dict(json=SCHEMA, disable_any_whitespace=True),
    "regex": dict(regex=REGEX),
    "choice": dict(choice=CHOICES),
}
PROMPTS = ["abcabcabc", '[{"k": "v", "n": 1}, {"k', "1, 2, 1, 2, 1, 2", "hello"]
K = 3


def check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


@pytest.fixture(scope="module")
def draft_model(tiny_char_model, tmp_path_factory) -> str:
    """The target with the output rows of every token that no constraint here uses set to zero: its greedy draft is
    the target's best token among those the constraints use (a random model's unconstrained best token almost never
    fits a grammar: all its drafts would be cut). Where the grammar allows the draft, the target's masked argmax is
    that token (the mask allows a subset of the used tokens): drafts are accepted, and cut or rejected elsewhere."""
    used = set(char_tokenizer()("".join([json.dumps(SCHEMA), REGEX, "0123456789", *CHOICES]))["input_ids"])
    model = transformers.LlamaForCausalLM.from_pretrained(tiny_char_model)
    with torch.no_grad():
        unused = torch.ones(model.config.vocab_size, dtype=torch.bool)
        unused[sorted(used | {EOS_ID})] = False
        model.lm_head.weight[unused] = 0.0
    path = tmp_path_factory.mktemp("grammar_draft")
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def spec_llm(request, tiny_char_model) -> LLM:
    """n-gram prompt lookup, or a draft model (draft_model above)."""
    if request.param == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    else:
        draft = request.getfixturevalue("draft_model")
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": K}
    return LLM(tiny_char_model, dtype="float32", kv_cache_memory_bytes=8 << 20, speculative_config=spec)


def run(llm: LLM, params: SamplingParams) -> tuple[list, int, int]:
    """The outputs (token ids, text, finish reason), and the drafts verified and accepted meanwhile."""
    sched = llm.llm_engine.core.scheduler
    before = (sched.num_draft_tokens, sched.num_accepted_tokens)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    got = [(c.token_ids, c.text, c.finish_reason) for o in outs for c in o.outputs]
    return got, sched.num_draft_tokens - before[0], sched.num_accepted_tokens - before[1]


def params(backend: str, kind: str, **sampling) -> SamplingParams:
    constraint = StructuredOutputsParams(**CONSTRAINTS[kind], backend=backend)
    return SamplingParams(**(dict(temperature=0, max_tokens=80) | sampling), structured_outputs=constraint)


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_greedy_outputs_equal_without_drafts(tiny_llm, spec_llm, backend, kind):
    pytest.importorskip("xgrammar" if backend == "xgrammar" else "llguidance")
    expected, _, _ = run(tiny_llm, params(backend, kind))
    got, num_drafts, num_accepted = run(spec_llm, params(backend, kind))
    assert got == expected
    for _, text, finish_reason in got:
        assert finish_reason == "stop"  # every constraint here is finite: the grammar ends the output
        check(kind, text)
    assert num_drafts > 0 and num_accepted > 0, (num_drafts, num_accepted)


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_seeded_sampling_equals_without_drafts(tiny_llm, spec_llm, kind):
    """Seeded sampled rows (n = 2) draw each position by (seed, position) under that position's mask: the same
    tokens with or without drafts, so the masked distribution is the one without drafts."""
    sampled = params("xgrammar", kind, temperature=0.7, seed=5, n=2)
    expected, _, _ = run(tiny_llm, sampled)
    got, num_drafts, _ = run(spec_llm, sampled)
    assert got == expected and num_drafts > 0
    for _, text, finish_reason in got:
        if finish_reason == "stop":
            check(kind, text)


def test_async_scheduling_with_drafts(tiny_llm, tiny_char_model):
    """Async scheduling with n-gram drafts: asynchronous steps (no drafts) while the batch is above
    disable_by_batch_size, synchronous ones with drafts below it; a constrained row's masks always follow its known
    tokens, and the outputs are those without speculation."""
    spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "disable_by_batch_size": 2}
    llm = LLM(
        tiny_char_model, dtype="float32", kv_cache_memory_bytes=8 << 20, speculative_config=spec,
        async_scheduling=True,
    )  # fmt: skip
    for kind in CONSTRAINTS:
        batch = [params("xgrammar", kind, max_tokens=m) for m in (3, 6, 40, 40)]
        expected = tiny_llm.generate(PROMPTS, batch, use_tqdm=False)
        got = llm.generate(PROMPTS, batch, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert llm.llm_engine.core.scheduler.num_accepted_tokens > 0


@pytest.mark.parametrize("kind", ["regex", "choice"])
def test_ignore_eos_ends_where_the_grammar_ends(tiny_llm, kind):
    """With ignore_eos the grammar's end (its EOS) ends the request. Drafts replaying the outputs (ReplayProposer)
    end with the EOS: it is accepted, and the token verified after it (a position whose mask allows everything) is
    dropped: the outputs are those without drafts."""
    sampling = params("xgrammar", kind, ignore_eos=True)
    outs = tiny_llm.generate(PROMPTS, sampling, use_tqdm=False)
    expected = [(c.token_ids, c.text, c.finish_reason) for o in outs for c in o.outputs]
    assert all(finish_reason == "stop" and ids[-1] == EOS_ID for ids, _, finish_reason in expected)
    sequences = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    config = tiny_llm.llm_engine.config
    config.speculative_proposer = ReplayProposer(sequences, num_drafts=K, vocab_size=MODEL_VOCAB)
    try:
        got, num_drafts, num_accepted = run(tiny_llm, sampling)
    finally:
        config.speculative_proposer = None
    assert got == expected and num_accepted == num_drafts > 0  # every draft accepted, the EOS ones too


def test_draft_model_mixes_constrained_penalized_and_plain_rows(tiny_llm, tiny_char_model, draft_model):
    """One batch of a constrained row (its drafts read on the host, checked against its grammar), a penalized row
    (its penalties count its drafts: read on the host too) and plain rows (drafts left on the device, placed into
    the verify step's inputs there: spec_decode/device_drafts.py): the outputs are those without speculation."""
    spec = {"method": "draft_model", "model": draft_model, "num_speculative_tokens": K}
    llm = LLM(tiny_char_model, dtype="float32", kv_cache_memory_bytes=8 << 20, speculative_config=spec)
    batch = [
        params("xgrammar", "regex"),
        SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=24),
        SamplingParams(temperature=0.8, seed=3, max_tokens=24, logprobs=1),
    ]
    expected = tiny_llm.generate(PROMPTS, batch, use_tqdm=False)
    got = llm.generate(PROMPTS, batch, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    check("regex", got[0].outputs[0].text)
    sched = llm.llm_engine.core.scheduler
    assert sched.num_accepted_tokens > 0 and sched.num_draft_tokens > sched.num_accepted_tokens
