"""The xgrammar backend's mask fill: length-bounded JSON strings become chains of rules whose masks equal those of
xgrammar's own grammar at every step (SmolLM2's BPE vocabulary, random walks under the mask), xgrammar fills only
the tokenizer's words of a row (a model's padded ids stay zero), and a step's masks use a bounded number of threads."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from char_tokenizer import EOS_ID, char_tokenizer

xgr = pytest.importorskip("xgrammar")

from pagedllm.sampling_params import GuidedDecodingParams  # noqa: E402
from pagedllm.structured_output import StructuredOutputManager, fill_bitmasks  # noqa: E402
from pagedllm.structured_output import xgrammar_backend as xb  # noqa: E402
from pagedllm.structured_output.bounded_strings import MAX_BOUND, rewrite, tighten  # noqa: E402

SCHEMAS = [
    {  # the structured output benchmark's
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "skills": {"type": "array", "items": {"type": "string", "maxLength": 20}},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        },
        "required": ["name", "skills", "zip"],
    },
    {"type": "string", "minLength": 3, "maxLength": 10},
    {"type": "string", "minLength": 2, "maxLength": 2},
    {"type": "string", "maxLength": 2},
    {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 5}, "maxItems": 6},
]
COUNTED = re.compile(r'\{\d+, \d+\} "\\""')  # a counted repetition before a closing quote


@pytest.fixture(scope="module")
def smollm2_backend(smollm2):
    from pagedllm.model_loader.gguf_loader import gguf_tokenizer

    tokenizer = gguf_tokenizer(smollm2)
    return xb.XgrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def allowed_ids(words: torch.Tensor) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(words.numpy().view(np.uint8), bitorder="little"))


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
def test_bounded_strings_keep_xgrammar_masks(smollm2_backend, schema):
    """Each step of three random walks (tokens drawn from the allowed set, so strings run up to their bounds): the
    backend's grammar allows exactly the tokens xgrammar's own grammar for the schema allows."""
    backend, spec = smollm2_backend, json.dumps(schema)
    ours = backend.parse(GuidedDecodingParams(json=schema), spec, "structured_outputs")
    theirs = xgr.Grammar.from_json_schema(spec, strict_mode=True, any_whitespace=True, max_whitespace_cnt=16)
    theirs = xgr.Grammar.from_ebnf(tighten(str(theirs)))  # (without control characters: see the test below)
    assert COUNTED.search(str(theirs)) and not COUNTED.search(str(ours))
    compiled = [backend.compile(ours), backend.compile(theirs)]
    rng = np.random.default_rng(0)
    for _ in range(3):
        matchers = [xgr.GrammarMatcher(c) for c in compiled]
        for _ in range(80):
            masks = torch.zeros((2, backend.fill_words), dtype=torch.int32)
            for row, m in enumerate(matchers):
                m.fill_next_token_bitmask(masks, row)
            assert torch.equal(masks[0], masks[1])
            token = int(rng.choice(allowed_ids(masks[0])))
            assert [m.accept_token(token) for m in matchers] == [True, True]
            assert matchers[0].is_completed() == matchers[1].is_completed()
            if matchers[0].is_terminated():
                break


def test_rewrite_leaves_what_it_does_not_chain():
    """Bounds over MAX_BOUND and unbounded strings (minLength alone) stay counted (their classes tightened); so does a
    text whose new rule names are taken."""
    for schema in ({"type": "string", "maxLength": MAX_BOUND + 1}, {"type": "string", "minLength": 5}):
        text = str(xgr.Grammar.from_json_schema(json.dumps(schema)))
        assert tighten(text) != text and rewrite(text) == tighten(text)
        assert COUNTED.search(rewrite(text)) or "{5, -1}" in rewrite(text)
    text = str(xgr.Grammar.from_json_schema(json.dumps({"type": "string", "maxLength": 3})))
    assert rewrite(text) != tighten(text)
    taken = text + 'root_characters_upto_3 ::= (("x"))\n'
    assert rewrite(taken) == tighten(taken)


@pytest.mark.parametrize("max_length", [8, MAX_BOUND + 1])
def test_bounded_strings_refuse_raw_control_characters(max_length):
    """JSON forbids unescaped U+0000-U+001F in a string; xgrammar's class for length-bounded strings lets them in
    (an output json.loads refuses). The backend's grammar refuses them, chained or not, and still takes the rest."""
    manager = StructuredOutputManager(char_tokenizer(), 128, [EOS_ID], default_backend="xgrammar")
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": max_length}},
        "required": ["name"],
    }
    grammar = manager.backend.parse(GuidedDecodingParams(json=schema), json.dumps(schema), "structured_outputs")
    compiled = manager.backend.compile(grammar)
    for bad in ("\x15", "\t", "\x00", "\x1f"):
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_string('{"name": "ab')
        assert not matcher.accept_string(bad), repr(bad)
    matcher = xgr.GrammarMatcher(compiled)
    assert matcher.accept_string('{"name": "a b~"}') and matcher.is_completed()


def test_only_the_tokenizer_words_are_filled():
    """A model vocab of 1024 on a 97-token tokenizer: xgrammar fills the first 4 words of each row (ids 0..127),
    the other 28 stay zero, on the batched path and the single-row one alike, and the allowed ids are the same as
    with xgrammar given the whole padded vocab."""
    vocab = 1024
    manager = StructuredOutputManager(char_tokenizer(), vocab, [EOS_ID], default_backend="xgrammar")
    backend = manager.backend
    assert (backend.num_words, backend.fill_words) == (32, 4)
    params = GuidedDecodingParams(json={"type": "object", "properties": {"a": {"type": "string"}}})
    padded = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(char_tokenizer(), vocab_size=vocab))
    reference = xgr.GrammarMatcher(padded.compile_grammar(backend.parse(params, json.dumps(params.json), "f")))
    expected = torch.zeros((1, 32), dtype=torch.int32)
    for num_rows in (1, 5):  # below and above the batched fill's threshold
        grammars = {str(i): manager.request_grammar(manager.grammar(params)) for i in range(num_rows)}
        for g in grammars.values():
            g.compiled.result()
            assert g.accept(char_tokenizer()('{"a"')["input_ids"]) == 4
        reference.reset()
        assert reference.accept_string('{"a"')
        reference.fill_next_token_bitmask(expected, 0)
        masks = fill_bitmasks(grammars)
        for mask in masks.values():
            assert mask.shape == (32,) and not mask[4:].any()
            assert np.array_equal(mask, expected[0].numpy())


def test_fill_threads_bounded(monkeypatch, tmp_path):
    """Half the cores the process may use (affinity, then the cgroup's CPU quota), 1 to 8."""
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("max 100000\n")
    for cores, threads in ((1, 1), (2, 1), (6, 3), (16, 8), (224, 8)):
        monkeypatch.setattr(xb.os, "sched_getaffinity", lambda pid, n=cores: set(range(n)), raising=False)
        assert xb.fill_threads(str(cpu_max)) == threads
    cpu_max.write_text("400000 100000\n")  # a quota of 4 cores on a host of 224
    assert xb.fill_threads(str(cpu_max)) == 2
