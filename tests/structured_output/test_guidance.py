"""The llguidance backend ("guidance") on the tiny character-level Llama: JSON schemas validate (jsonschema is the
oracle), regexes fully match, choices are members, Lark and GBNF grammars are followed; its bitmask equals
xgrammar's step by step; "auto" takes xgrammar and falls back to guidance where xgrammar refuses the constraint
or fails to compile it; an unknown backend is a ValueError naming the field."""

from __future__ import annotations

import json
import re
import sys
import time

import jsonschema
import numpy as np
import pytest
from char_tokenizer import EOS_ID, MODEL_VOCAB, char_tokenizer
from test_engine import PROMPTS, SCHEMAS, constrained, texts

from pagedllm import SamplingParams, StructuredOutputsParams
from pagedllm.engine_args import EngineArgs
from pagedllm.structured_output import StructuredOutputManager, fill_bitmasks

pytest.importorskip("llguidance")

LARK = 'start: "(" pair ("," pair)* ")"\npair: KEY "=" VALUE\nKEY: /[a-c]/\nVALUE: /[0-9]{1,2}/\n'
LARK_TEXT = re.compile(r"\((?:[a-c]=[0-9]{1,2})(?:,[a-c]=[0-9]{1,2})*\)")


@pytest.fixture(scope="module")
def manager() -> StructuredOutputManager:
    return StructuredOutputManager(char_tokenizer(), MODEL_VOCAB, [EOS_ID])


def allowed(grammar) -> set[int]:
    words = fill_bitmasks({"r": grammar})["r"]  # int32 [ceil(vocab / 32)]
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def tok(text: str) -> list[int]:
    return char_tokenizer()(text)["input_ids"]


def backend_of(manager, params: StructuredOutputsParams) -> str:
    return manager.grammar(params).result(timeout=30).backend.name


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schemas_validate(tiny_llm, name):
    schema = SCHEMAS[name]
    params = constrained({"n": 2}, json=schema, disable_any_whitespace=True, backend="guidance")
    for text in texts(tiny_llm.generate(PROMPTS, params, use_tqdm=False)):
        jsonschema.validate(json.loads(text), schema)


def test_regex_choice_and_grammars(tiny_llm):
    regex = r"[a-d]{2,4}-[0-9]{1,3}"
    for text in texts(tiny_llm.generate(PROMPTS, constrained(regex=regex, backend="guidance"), use_tqdm=False)):
        assert re.fullmatch(regex, text), text
    choices = ["alpha", "beta", "gamma delta"]
    for text in texts(tiny_llm.generate(PROMPTS, constrained(choice=choices, backend="guidance"), use_tqdm=False)):
        assert text in choices
    for text in texts(tiny_llm.generate(PROMPTS, constrained(grammar=LARK, backend="guidance"), use_tqdm=False)):
        assert LARK_TEXT.fullmatch(text), text
    gbnf = 'root ::= "<" [x-z]+ ">"'
    params = constrained({"max_tokens": 12}, grammar=gbnf, backend="guidance")
    for out in tiny_llm.generate(PROMPTS, params, use_tqdm=False):
        text = out.outputs[0].text
        assert re.fullmatch(r"<[x-z]+>", text) or (out.outputs[0].finish_reason == "length" and text[0] == "<")


def test_lark_with_inlined_rules(tiny_llm, manager):
    """vLLM's docs' Lark grammar: `?` rules and no `start:` line. Without `::=` a grammar is Lark (vLLM's rule), so
    neither llguidance's GBNF guess nor xgrammar's EBNF parser gets it; xgrammar, asked by name, says why."""
    grammar = '?start: sel\n?sel: "SELECT " /[a-c]{1,3}/'
    for backend in ("guidance", "auto"):
        assert backend_of(manager, StructuredOutputsParams(grammar=grammar, backend=backend)) == "guidance"
        params = constrained({"max_tokens": 16}, grammar=grammar, backend=backend)
        for text in texts(tiny_llm.generate(PROMPTS, params, use_tqdm=False)):
            assert re.fullmatch("SELECT [a-c]{1,3}", text), text
    with pytest.raises(ValueError, match=r"structured_outputs\.grammar is invalid: .*Lark grammar"):
        manager.grammar(StructuredOutputsParams(grammar=grammar, backend="xgrammar"))
    gbnf = 'root ::= "<" [x-z] ">"'  # GBNF still reaches both backends
    assert backend_of(manager, StructuredOutputsParams(grammar=gbnf, backend="auto")) == "xgrammar"
    assert backend_of(manager, StructuredOutputsParams(grammar=gbnf, backend="guidance")) == "guidance"


def test_whitespace_pattern(tiny_llm):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = constrained({"n": 2}, json=schema, whitespace_pattern=r"[\n]{0,1}")
    for text in texts(tiny_llm.generate(PROMPTS, params, use_tqdm=False)):
        jsonschema.validate(json.loads(text), schema)
        assert " " not in text.replace('" ', "")  # whitespace only as the pattern allows
    with pytest.raises(ValueError, match="whitespace_pattern"):
        tiny_llm.generate("x", constrained(json=schema, whitespace_pattern=" ?", backend="xgrammar"), use_tqdm=False)


def test_same_bitmask_as_xgrammar(manager):
    """Along a path, the guidance matcher allows exactly the tokens xgrammar allows, and accepts/rolls back alike."""
    params = [
        dict(regex=r"(ab|ac)[0-9]{1,2}"),
        dict(choice=["ab", "ac", "b"]),
        dict(json={"type": "object", "properties": {"k": {"enum": ["x", "y"]}}, "required": ["k"]}),
    ]
    paths = ["ac7", "ac", '{"k": "y"}']
    for kw, path in zip(params, paths):
        grammars = {
            name: manager.request_grammar(manager.grammar(StructuredOutputsParams(**kw, backend=name)))
            for name in ("xgrammar", "guidance")
        }
        for g in grammars.values():
            g.compiled.result(timeout=30)
        for token in tok(path):
            assert allowed(grammars["guidance"]) == allowed(grammars["xgrammar"]), (kw, token)
            assert all(g.accept([token]) == 1 for g in grammars.values())
        assert all(g.is_completed() for g in grammars.values())
        assert grammars["guidance"].accept([ord("~") - 32]) == 0  # a refused token: nothing taken, no error state
        grammars["guidance"].rollback(1)
        assert not grammars["guidance"].is_terminated()
        assert grammars["guidance"].accept(tok(path[-1]) + [EOS_ID]) == 2 and grammars["guidance"].is_terminated()


def test_auto_prefers_xgrammar_and_falls_back(manager, monkeypatch):
    assert backend_of(manager, StructuredOutputsParams(regex="[0-9]+")) == "xgrammar"
    assert backend_of(manager, StructuredOutputsParams(grammar=LARK)) == "guidance"  # xgrammar reads no Lark
    assert backend_of(manager, StructuredOutputsParams(json={"type": "object"}, whitespace_pattern=" ?")) == "guidance"
    with pytest.raises(ValueError, match="grammar"):  # neither parses it: xgrammar's error, at once
        manager.grammar(StructuredOutputsParams(grammar="root ::= ("))
    xgrammar = manager.get_backend("xgrammar")

    def fail(_):
        raise RuntimeError("out of memory while compiling")

    monkeypatch.setattr(xgrammar, "compile", fail)
    assert backend_of(manager, StructuredOutputsParams(regex="[0-9]+x")) == "guidance"  # compile failed: guidance
    with pytest.raises(RuntimeError):  # asked for by name: no fallback
        manager.grammar(StructuredOutputsParams(regex="[0-9]+y", backend="xgrammar")).result(timeout=30)


def test_engine_default_backend(tiny_char_model):
    from pagedllm import LLM

    llm = LLM(tiny_char_model, dtype="float32", kv_cache_memory_bytes=8 << 20, guided_decoding_backend="guidance")
    manager = llm.llm_engine.structured_output_manager()
    assert backend_of(manager, StructuredOutputsParams(regex="[0-9]+z")) == "guidance"
    assert backend_of(manager, StructuredOutputsParams(regex="[0-9]+z", backend="xgrammar")) == "xgrammar"
    out = llm.generate("x", constrained(regex="[0-9]{3}"), use_tqdm=False)[0].outputs[0].text
    assert re.fullmatch("[0-9]{3}", out)


def test_unknown_backend_is_a_clear_error(tiny_char_model):
    with pytest.raises(ValueError, match=r"guided_decoding_backend='outlines'.*auto, xgrammar, guidance"):
        EngineArgs(model=tiny_char_model, guided_decoding_backend="outlines").create_engine_config()
    with pytest.raises(ValueError, match=r"structured_outputs\.backend"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a", backend="outlines"))
    with pytest.raises(ValueError, match="guidance.*structural_tag|structural_tag.*guidance"):
        manager = StructuredOutputManager(char_tokenizer(), MODEL_VOCAB, [EOS_ID], default_backend="guidance")
        tag = {"structures": [{"begin": "<a>", "schema": {"type": "object"}, "end": "</a>"}], "triggers": ["<a>"]}
        manager.grammar(StructuredOutputsParams(structural_tag=json.dumps(tag)))


@pytest.mark.parametrize(
    "constraint,message",
    [
        ({"json": {"type": "bogus"}}, "structured_outputs.json is invalid"),
        ({"regex": "a(b"}, "structured_outputs.regex is invalid"),
        ({"regex": "(a+)+b" * 50}, None),  # nested quantifiers: llguidance's lexer does not backtrack
        ({"grammar": "start: ("}, "structured_outputs.grammar is invalid"),
        ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar is invalid"),
    ],
)
def test_bad_constraints_fail_fast_and_the_engine_lives(tiny_llm, constraint, message):
    start = time.monotonic()
    params = SamplingParams(max_tokens=4, structured_outputs=dict(constraint, backend="guidance"))
    if message is None:
        tiny_llm.generate(["x"], params, use_tqdm=False)
    else:
        with pytest.raises(ValueError, match=re.escape(message)):
            tiny_llm.generate(["x"], params, use_tqdm=False)
    assert time.monotonic() - start < 2.0
    out = tiny_llm.generate(["x"], constrained(choice=["fine"], backend="guidance"), use_tqdm=False)
    assert out[0].outputs[0].text == "fine"


def test_auto_without_xgrammar(monkeypatch):
    """Without the xgrammar package, "auto" takes guidance and asking for xgrammar is a ValueError saying what to
    install."""
    monkeypatch.setitem(sys.modules, "pagedllm.structured_output.xgrammar_backend", None)  # its import fails
    manager = StructuredOutputManager(char_tokenizer(), MODEL_VOCAB, [EOS_ID])
    assert backend_of(manager, StructuredOutputsParams(regex="[0-9]+")) == "guidance"
    for _ in range(2):  # the second time from the remembered failure
        with pytest.raises(ValueError, match=r"needs the xgrammar package: pip install 'pagedllm\[structured\]'"):
            manager.grammar(StructuredOutputsParams(regex="[0-9]+", backend="xgrammar"))


def test_structured_outputs_config_forms(tiny_char_model):
    """vLLM's structured_outputs_config (keyword, JSON flag, dotted flag) chooses the engine's default backend."""
    import argparse

    config = EngineArgs(model=tiny_char_model, structured_outputs_config={"backend": "guidance"}).create_engine_config()
    assert config.guided_decoding_backend == "guidance"
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    for flags in (
        ["--structured-outputs-config", '{"backend": "xgrammar"}'],
        ["--structured-outputs-config.backend", "xgrammar"],
        ["--guided-decoding-backend", "xgrammar"],
    ):
        args = EngineArgs(model=tiny_char_model, **EngineArgs.cli_kwargs(parser.parse_args(flags)))
        assert args.create_engine_config().guided_decoding_backend == "xgrammar", flags
    for bad in ({"backend": "outlines"}, {"backend": "xgrammar", "nope": 1}):
        with pytest.raises(ValueError, match="structured_outputs_config"):
            EngineArgs(model=tiny_char_model, structured_outputs_config=bad).create_engine_config()
