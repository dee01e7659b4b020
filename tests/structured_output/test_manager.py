"""The grammar side without generation: compiled once per constraint, a request waits in the scheduler while its
grammar compiles (the others run), a grammar that fails to compile ends only its request, padded vocab ids are
never allowed, and a matcher rolls back rejected tokens."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from char_tokenizer import EOS_ID, MODEL_VOCAB, char_tokenizer

from pagedllm import SamplingParams, StructuredOutputsParams
from pagedllm.structured_output import StructuredOutputManager, fill_bitmasks


@pytest.fixture(scope="module")
def manager() -> StructuredOutputManager:
    return StructuredOutputManager(char_tokenizer(), MODEL_VOCAB, [EOS_ID])


def allowed(manager, grammar) -> set[int]:
    words = fill_bitmasks({"r": grammar})["r"]  # int32 [ceil(vocab / 32)]
    assert words.shape == ((MODEL_VOCAB + 31) // 32,)
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits[:MODEL_VOCAB]).tolist())


def tok(text: str) -> list[int]:
    return char_tokenizer()(text)["input_ids"]


def test_compiled_once_and_shared(manager):
    a = manager.grammar(StructuredOutputsParams(json={"type": "object", "properties": {"x": {"type": "integer"}}}))
    b = manager.grammar(StructuredOutputsParams(json='{"type": "object",  "properties": {"x": {"type": "integer"}}}'))
    assert a is b  # the same schema as a dict or as text
    assert manager.grammar(StructuredOutputsParams(regex="x")) is not a


def test_bitmask_accept_rollback_terminate(manager):
    grammar = manager.request_grammar(manager.grammar(StructuredOutputsParams(choice=["ab", "ac", "b"])))
    grammar.compiled.result()
    assert allowed(manager, grammar) == set(tok("ab"[:1] + "b"))  # "a" or "b"
    assert grammar.accept(tok("a")) == 1
    assert allowed(manager, grammar) == set(tok("bc"))
    assert grammar.accept(tok("bz")) == 1  # "z" refused: one taken
    assert allowed(manager, grammar) == {EOS_ID}
    grammar.rollback(1)  # back to after "a"
    assert allowed(manager, grammar) == set(tok("bc"))
    assert grammar.accept(tok("c") + [EOS_ID]) == 2 and grammar.is_terminated()


def test_padded_ids_never_allowed(manager):
    grammar = manager.request_grammar(manager.grammar(StructuredOutputsParams(regex=r"[\s\S]*")))
    grammar.compiled.result()
    assert allowed(manager, grammar) == set(range(EOS_ID + 1))  # every real token; none of ids 97..127


def _step_until_done(engine, limit: int = 200) -> dict:
    outputs = {}
    for _ in range(limit):
        for out in engine.step():
            outputs[out.request_id] = out
        if not engine.has_unfinished_requests():
            return outputs
    raise AssertionError("the engine did not finish")


def test_request_waits_for_its_grammar(tiny_llm, monkeypatch):
    engine = tiny_llm.llm_engine
    backend = engine.structured_output_manager().backend
    release = threading.Event()
    compile_ = backend.compile
    monkeypatch.setattr(backend, "compile", lambda g: release.wait(30) and compile_(g))
    engine.add_request("slow", tok("hi"), SamplingParams(max_tokens=8, structured_outputs={"regex": "[0-9]{4}"}))
    engine.add_request("free", tok("hi"), SamplingParams(temperature=0, max_tokens=4))
    free_done = []
    for _ in range(20):
        free_done += [o.request_id for o in engine.step()]
        if free_done:
            break
    assert free_done == ["free"]  # the unconstrained request ran to its end meanwhile
    assert "slow" in {r.request_id for r in engine.core.scheduler.waiting}
    release.set()
    out = _step_until_done(engine)["slow"]
    assert len(out.outputs[0].text) == 4 and out.outputs[0].text.isdigit()


def test_compile_failure_ends_only_its_request(tiny_llm, monkeypatch):
    engine = tiny_llm.llm_engine
    backend = engine.structured_output_manager().backend

    def fail(_):
        raise RuntimeError("out of memory while compiling")

    monkeypatch.setattr(backend, "compile", fail)
    xgrammar_only = {"regex": "never-cached", "backend": "xgrammar"}  # "auto" would fall back to guidance
    engine.add_request("bad", tok("x"), SamplingParams(max_tokens=4, structured_outputs=xgrammar_only))
    engine.add_request("good", tok("x"), SamplingParams(temperature=0, max_tokens=3))
    outs = _step_until_done(engine)
    assert outs["bad"].outputs[0].finish_reason == "abort" and outs["bad"].outputs[0].token_ids == []
    assert len(outs["good"].outputs[0].token_ids) == 3


def test_legacy_structural_tag(manager):
    """vLLM's older structural tag: free text, and after a trigger the tagged JSON of its schema."""
    legacy = {
        "structures": [{"begin": "<f>", "schema": {"enum": ["yes"]}, "end": "</f>"}],
        "triggers": ["<f>"],
    }
    grammar = manager.request_grammar(manager.grammar(StructuredOutputsParams(structural_tag=json.dumps(legacy))))
    grammar.compiled.result()
    assert grammar.accept(tok("any text <f>")) == len("any text <f>")
    assert allowed(manager, grammar) == set(tok('"'))  # the schema's JSON now
    assert grammar.accept(tok('"yes"</f>')) == len('"yes"</f>')
    assert grammar.accept(tok("x")) == 1  # free text again
