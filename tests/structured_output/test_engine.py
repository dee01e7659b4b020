"""Structured outputs end to end on a tiny random Llama with a character-level tokenizer (tests/structured_output/
conftest.py): every output parses and validates against its schema (the jsonschema package is the oracle), regexes
fully match, choices are members; the mask changes nothing where it never bites; n > 1, seeds, logprobs, prefix
caching, preemption, stop strings and async scheduling keep all of that; bad constraints are a ValueError at once."""

from __future__ import annotations

import importlib.util
import json
import re
import time

import jsonschema
import pytest
from char_tokenizer import EOS_ID

from pagedllm import LLM, SamplingParams, StructuredOutputsParams

DEEP: list = [1]
for _ in range(40):
    DEEP = [DEEP]

PROMPTS = ["hello", "{", "The answer is", "abc def"]

# finite schemas (bounded strings, arrays and integers, no free whitespace): a random model always completes them
SCHEMAS = {
    "nested objects": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 4},
            "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
        },
        "required": ["name", "inner"],
    },
    "arrays": {
        "type": "object",
        "properties": {
            "xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3}
        },
        "required": ["xs"],
    },
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", 3, None]}}, "required": ["color"]},
    "union": {
        "type": "object",
        "properties": {"v": {"anyOf": [{"type": "boolean"}, {"type": "string", "maxLength": 2}, {"type": "null"}]}},
        "required": ["v"],
    },
    "refs": {
        "$defs": {
            "pt": {"type": "object", "properties": {"x": {"$ref": "#/$defs/small"}}, "required": ["x"]},
            "small": {"type": "integer", "minimum": -5, "maximum": 5},
        },
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
        "required": ["a", "b"],
    },
    "number bounds": {
        "type": "object",
        "properties": {
            "i": {"type": "integer", "minimum": 10, "maximum": 20},
            "j": {"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 3},
        },
        "required": ["i", "j"],
    },
    "array of objects": {
        "type": "array",
        "items": {"type": "object", "properties": {"k": {"const": "v"}}, "required": ["k"]},
        "minItems": 1,
        "maxItems": 2,
    },
}


def constrained(sampling: dict | None = None, **constraint) -> SamplingParams:
    kwargs = dict(temperature=0.8, seed=0, max_tokens=120) | (sampling or {})
    return SamplingParams(**kwargs, structured_outputs=StructuredOutputsParams(**constraint))


def texts(outs) -> list[str]:
    return [c.text for o in outs for c in o.outputs]


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_validate(tiny_llm, name):
    schema = SCHEMAS[name]
    params = constrained({"n": 3, "seed": 11}, json=schema, disable_any_whitespace=True)
    outs = tiny_llm.generate(PROMPTS, params, use_tqdm=False)
    for c in (c for o in outs for c in o.outputs):
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), schema)
        assert all(t < EOS_ID for t in c.token_ids[:-1]) and c.token_ids[-1] == EOS_ID


def test_json_object_and_free_whitespace(tiny_llm):
    outs = tiny_llm.generate(PROMPTS, constrained({"max_tokens": 400}, json_object=True), use_tqdm=False)
    for c in (c for o in outs for c in o.outputs):
        if c.finish_reason == "stop":  # a random model may write a long object: then it ends by length
            assert isinstance(json.loads(c.text), dict)
    assert any(o.outputs[0].finish_reason == "stop" for o in outs)


def test_json_object_without_free_whitespace(tiny_llm):
    """disable_any_whitespace holds for json_object too: outside strings, whitespace only in the fixed separators."""
    params = constrained({"max_tokens": 400, "n": 3, "seed": 2}, json_object=True, disable_any_whitespace=True)
    outs = tiny_llm.generate(PROMPTS, params, use_tqdm=False)
    for c in (c for o in outs for c in o.outputs):
        outside = re.sub(r'"(\\.|[^"\\])*"', "", c.text)  # the text with its (complete) strings removed
        outside = outside.split('"')[0].replace(", ", ",").replace(": ", ":")
        assert not re.search(r"\s", outside), c.text


@pytest.mark.parametrize("regex", [r"[a-c]{2,5}-\d\d", r"(yes|no)!", r"\w+@\w+\.com", r"[0-9]{3}( [A-Z])?"])
def test_regex_fully_matches(tiny_llm, regex):
    outs = tiny_llm.generate(PROMPTS, constrained({"n": 2, "max_tokens": 60}, regex=regex), use_tqdm=False)
    for c in (c for o in outs for c in o.outputs):
        if c.finish_reason == "stop":
            assert re.fullmatch(regex, c.text), c.text
        else:  # only the unbounded \w+ may run out of tokens; its text is still a prefix of a match
            assert "+" in regex and c.finish_reason == "length"


def test_choices_and_grammar(tiny_llm):
    choices = ['say "hi"', "no\\way", "x"]
    for text in texts(tiny_llm.generate(PROMPTS, constrained({"n": 3}, choice=choices), use_tqdm=False)):
        assert text in choices
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9]'
    for text in texts(tiny_llm.generate(PROMPTS, constrained(grammar=grammar, regex=None), use_tqdm=False)):
        assert re.fullmatch(r"\([1-9](\+[1-9])*\)", text)


def test_mask_that_never_bites_changes_nothing(tiny_llm):
    """Any printable text: the grammar allows exactly the tokenizer's tokens (and EOS anywhere), as
    allowed_token_ids does: the greedy tokens are the same. The grammar's mask comes before the logprobs (as vLLM
    applies it to the logits before the sampler), allowed_token_ids after them: the grammar's logprobs are over
    the allowed tokens only, each at least the unmasked one."""
    allowed = SamplingParams(temperature=0, max_tokens=20, logprobs=3, allowed_token_ids=list(range(EOS_ID + 1)))
    grammar = SamplingParams(temperature=0, max_tokens=20, logprobs=3, structured_outputs={"regex": r"[ -~\n]*"})
    free = tiny_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    a = tiny_llm.generate(PROMPTS, allowed, use_tqdm=False)
    g = tiny_llm.generate(PROMPTS, grammar, use_tqdm=False)
    for fo, ao, go in zip(free, a, g):
        assert go.outputs[0].token_ids == ao.outputs[0].token_ids
        for tok, da, dg in zip(go.outputs[0].token_ids, ao.outputs[0].logprobs, go.outputs[0].logprobs):
            assert all(t <= EOS_ID for t in dg) and dg[tok].rank == 1
            assert dg[tok].logprob >= da[tok].logprob - 1e-5
        if all(t <= EOS_ID for t in fo.outputs[0].token_ids):  # the free run never took an id past the tokenizer's
            assert fo.outputs[0].token_ids == go.outputs[0].token_ids
    # the padded ids (past the tokenizer's) are what the free model would otherwise take: the test must see them
    assert any(t > EOS_ID for o in free for t in o.outputs[0].token_ids)


def test_seeds_logprobs_and_stop_strings(tiny_llm):
    schema = SCHEMAS["arrays"]
    params = constrained({"n": 2, "seed": 5, "logprobs": 2}, json=schema, disable_any_whitespace=True)
    first = tiny_llm.generate(PROMPTS, params, use_tqdm=False)
    again = tiny_llm.generate(PROMPTS, params, use_tqdm=False)
    assert texts(first) == texts(again)
    assert len(set(texts(first))) > 1
    for c in (c for o in first for c in o.outputs):
        assert len(c.logprobs) == len(c.token_ids)
        for tok, entry in zip(c.token_ids, c.logprobs):
            assert entry[tok].logprob > -1e9
    outs = tiny_llm.generate(PROMPTS, constrained({"stop": [","]}, regex=r"abc,def"), use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert (c.text, c.finish_reason, c.stop_reason) == ("abc", "stop", ",")


def _engine(path: str, **kwargs) -> LLM:
    return LLM(path, dtype="float32", **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(async_scheduling=True),
        dict(num_gpu_blocks_override=40, block_size=4, max_num_batched_tokens=16),  # preemption, chunked prefill
        dict(enable_prefix_caching=True, kv_cache_memory_bytes=8 << 20),
    ],
    ids=["async", "preemption", "prefix-caching"],
)
def test_scheduling_modes_give_the_same_outputs(tiny_llm, tiny_char_model, kwargs):
    params = [
        constrained({"seed": 3, "max_tokens": 60}, json=SCHEMAS["refs"], disable_any_whitespace=True),
        constrained({"temperature": 0, "max_tokens": 60}, regex=r"[a-z]{3,8}\.[0-9]"),
        SamplingParams(temperature=0, max_tokens=30),
        constrained({"n": 2, "seed": 9, "max_tokens": 60}, choice=["alpha", "beta", "gamma"]),
    ]
    prompts = [p + " and some more words to share prefix blocks" for p in PROMPTS]
    reference = tiny_llm.generate(prompts, params, use_tqdm=False)
    llm = _engine(tiny_char_model, **kwargs)
    for _ in range(2):  # the second time from the prefix cache where it is on
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in reference]
    if "num_gpu_blocks_override" in kwargs:
        assert llm.llm_engine.core.scheduler.num_preemptions > 0


@pytest.mark.parametrize(
    "constraint,message",
    [
        ({"json": {"type": "bogus"}}, "structured_outputs.json is invalid"),
        ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
        ({"json": {"properties": {"a": {"$ref": "#/$defs/missing"}}}}, "structured_outputs.json is invalid"),
        ({"regex": "a(b"}, "structured_outputs.regex is invalid"),
        ({"regex": "a" * 70000}, "at most"),
        ({"grammar": "root ::= undefined"}, "structured_outputs.grammar is invalid"),
        ({"structural_tag": "[1, 2"}, "structured_outputs.structural_tag is invalid"),
        ({"json": "[" * 40 + "]" * 40}, "nests deeper"),
        ({"json": {"a": DEEP}}, "nests deeper"),
        ({"choice": [str(i) for i in range(2000)]}, "at most 1024"),
    ],
)
def test_bad_constraints_fail_fast_and_the_engine_lives(tiny_llm, constraint, message):
    start = time.monotonic()
    with pytest.raises(ValueError, match=re.escape(message)):
        tiny_llm.generate(["x"], SamplingParams(structured_outputs=constraint), use_tqdm=False)
    assert time.monotonic() - start < 1.0
    out = tiny_llm.generate(["x"], constrained(choice=["fine"]), use_tqdm=False)
    assert out[0].outputs[0].text == "fine"


@pytest.mark.parametrize("regex", [r"(a+)+b", r"((a{100}){100}){100}", r"(a|aa)*c", r"[a-z]{1,65535}"])
def test_pathological_regexes_do_not_hang(tiny_llm, regex):
    """Regexes that blow up a backtracking matcher or a naive automaton compile and run at once (both backends
    build automata lazily); the output is a full match, or a prefix of one when max_tokens cuts it; the engine lives."""
    for backend in ("xgrammar", "guidance"):
        if importlib.util.find_spec({"xgrammar": "xgrammar", "guidance": "llguidance"}[backend]) is None:
            continue  # (a backend not installed: its own error is tested elsewhere)
        start = time.monotonic()
        params = constrained({"max_tokens": 8}, regex=regex, backend=backend)
        out = tiny_llm.generate(["x"], params, use_tqdm=False)[0].outputs[0]
        assert time.monotonic() - start < 10.0
        # abort: llguidance's lexer outgrew its limits on the nested repeats; only that request ends
        assert (
            re.fullmatch(regex, out.text) if out.finish_reason == "stop" else out.finish_reason in ("length", "abort")
        )
    assert tiny_llm.generate(["x"], constrained(choice=["fine"]), use_tqdm=False)[0].outputs[0].text == "fine"


def test_needs_a_tokenizer(tiny_char_model):
    llm = _engine(tiny_char_model, skip_tokenizer_init=True, kv_cache_memory_bytes=4 << 20)
    with pytest.raises(ValueError, match="structured_outputs need a tokenizer"):
        llm.generate([[1, 2, 3]], constrained(choice=["a"]), use_tqdm=False)


def test_rules_that_fight_the_mask(tiny_llm):
    """min_tokens bans the EOS that alone is allowed once the choice is written: the refused token is dropped and
    the request stops there; with ignore_eos the grammar's end still ends it (EOS kept as the last token)."""
    for kwargs in (dict(min_tokens=3), dict(min_tokens=2, temperature=0, logprobs=1)):
        out = tiny_llm.generate(["hi"], constrained(kwargs, choice=["a"]), use_tqdm=False)[0].outputs[0]
        assert (out.text, out.token_ids, out.finish_reason) == ("a", tok("a"), "stop")
        assert out.logprobs is None or len(out.logprobs) == 1
    out = tiny_llm.generate(["hi"], constrained({"ignore_eos": True}, choice=["ab"]), use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == (tok("ab") + [EOS_ID], "stop")


def tok(text: str) -> list[int]:
    return [ord(c) - 32 for c in text]


def test_structural_tags(tiny_llm):
    """xgrammar's structural tag format (vLLM's older one: test_manager.py)."""
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "exactly this"}}
    out = tiny_llm.generate(["x"], constrained(structural_tag=json.dumps(tag)), use_tqdm=False)[0].outputs[0]
    assert out.text == "exactly this" and out.finish_reason == "stop"


def test_speculative_decoding_keeps_the_constrained_outputs(tiny_llm, tiny_char_model):
    """An engine with n-gram speculation keeps constrained requests' greedy outputs token for token, drafting for
    them too (one mask per draft position: test_grammar_drafts.py)."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    llm = LLM(tiny_char_model, dtype="float32", kv_cache_memory_bytes=8 << 20, speculative_config=spec)
    prompts = ["abcabcabc", '{"a": {"a": {"a', "1, 2, 1, 2, 1, 2"]
    for constraint in (
        {"json": SCHEMAS["array of objects"], "disable_any_whitespace": True},
        {"regex": r"(abc|[0-9], ){2,6}"},
    ):
        params = constrained({"temperature": 0, "max_tokens": 40}, **constraint)
        expected = [c.token_ids for o in tiny_llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]
        got = [c.token_ids for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]
        assert got == expected
    assert llm.llm_engine.core.scheduler.num_draft_tokens > 0  # constrained requests speculate


def test_pending_bitmasks_resolve_on_read_and_pickle_empty():
    """A step's masks are a mapping over a future; another rank (which never samples) gets an empty dict."""
    import pickle
    from concurrent.futures import Future

    import numpy as np

    from pagedllm.structured_output.manager import PendingBitmasks

    future = Future()
    masks = PendingBitmasks(future, ["a"])
    assert masks and list(masks) == ["a"] and len(masks) == 1 and not future.done()
    assert pickle.loads(pickle.dumps(masks)) == {}
    future.set_result({"a": np.array([5], dtype=np.int32)})
    assert masks["a"].tolist() == [5] and masks.get("b") is None


def test_masks_are_filled_while_the_forward_runs(tiny_llm, monkeypatch):
    """The runner launches a constrained step's forward before it reads the masks, which the scheduler's filler
    thread fills meanwhile: with a slow fill, every forward starts before its step's masks are done."""
    from pagedllm.structured_output import manager
    from pagedllm.worker.model_runner import ModelRunner

    events, fill, run_model = [], manager.fill_bitmasks, ModelRunner._run_model

    def slow_fill(*args):
        time.sleep(0.05)
        out = fill(*args)
        events.append("filled")
        return out

    def recorded_run_model(self, *args):
        events.append("forward")
        return run_model(self, *args)

    monkeypatch.setattr(manager, "fill_bitmasks", slow_fill)
    monkeypatch.setattr(ModelRunner, "_run_model", recorded_run_model)
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[a-c]{4}"))
    out = tiny_llm.generate(["x"], params, use_tqdm=False)
    assert re.fullmatch("[a-c]{4}", out[0].outputs[0].text)
    assert events.count("filled") == 4 and events[:2] == ["forward", "filled"]
    assert all(events[i] == "forward" for i in range(len(events) - 1) if events[i + 1] == "filled")
