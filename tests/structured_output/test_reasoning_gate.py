"""A grammar that starts after the reasoning: with reasoning markers set on the engine, a constrained request is
free until its output holds the end marker (`</think>`), then follows its grammar; a prompt that already closed its
reasoning is constrained from the first token; rollback across the marker closes the gate again."""

from __future__ import annotations

import re

import numpy as np
import pytest
from char_tokenizer import EOS_ID, MODEL_VOCAB, char_tokenizer

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.structured_output import StructuredOutputManager, fill_bitmasks
from pagedllm.structured_output.manager import reasoning_ended

START, END = "<think>", "</think>"


def tok(text: str) -> tuple[int, ...]:
    return tuple(char_tokenizer()(text)["input_ids"])


MARKERS = (tok(START), tok(END))


@pytest.fixture(scope="module")
def manager() -> StructuredOutputManager:
    return StructuredOutputManager(char_tokenizer(), MODEL_VOCAB, [EOS_ID])


def allowed(grammar) -> set[int]:
    bits = np.unpackbits(fill_bitmasks({"r": grammar})["r"].view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits[:MODEL_VOCAB]).tolist())


def test_reasoning_ended_in_prompt():
    assert reasoning_ended(list(tok("q<think>\n\n</think>\n\n")), *MARKERS)
    assert not reasoning_ended(list(tok("q<think>\n")), *MARKERS)
    assert not reasoning_ended(list(tok("a</think>b<think>c")), *MARKERS)  # a new section opened after the last end
    assert not reasoning_ended(list(tok("plain")), *MARKERS)


def test_gate_opens_after_end_marker_and_rolls_back(manager):
    compiled = manager.grammar(StructuredOutputsParams(regex="[0-9]{2}"))
    grammar = manager.request_grammar(compiled, list(tok("q<think>")), MARKERS)
    compiled.result()
    everything = set(range(MODEL_VOCAB))
    assert allowed(grammar) == everything and not grammar.is_completed() and not grammar.is_terminated()
    assert grammar.accept(list(tok("x!</thi"))) == 7
    assert allowed(grammar) == everything
    assert grammar.accept(list(tok("nk>4"))) == 4  # the end marker, then the grammar's first digit
    assert allowed(grammar) == set(tok("0123456789"))
    assert grammar.accept(list(tok("5z"))) == 1  # "z" refused by the grammar
    assert grammar.is_completed()
    grammar.rollback(3)  # "5", "4", ">": back inside the reasoning
    assert allowed(grammar) == everything
    assert grammar.accept(list(tok(">7"))) == 2 and allowed(grammar) == set(tok("0123456789"))


def test_prompt_that_ended_reasoning_is_constrained_at_once(manager):
    compiled = manager.grammar(StructuredOutputsParams(regex="[0-9]{2}"))
    grammar = manager.request_grammar(compiled, list(tok("<think>\n\n</think>\n\n")), MARKERS)
    compiled.result()
    assert allowed(grammar) == set(tok("0123456789"))


def _force(text: str):
    """A logits processor that writes `text` first, then leaves the logits alone."""
    ids = tok(text)

    def force(output_ids, logits):
        if len(output_ids) < len(ids):
            logits = logits.clone()
            keep = logits[ids[len(output_ids)]].item()
            logits.fill_(float("-inf"))
            logits[ids[len(output_ids)]] = keep if keep != float("-inf") else 0.0
        return logits

    return force


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_engine_applies_grammar_after_reasoning(tiny_llm, tiny_char_model, async_scheduling):
    """(With async scheduling a step's masks are filled once the previous step's tokens, which may open the gate,
    are in.)"""
    if async_scheduling:
        tiny_llm = LLM(tiny_char_model, dtype="float32", kv_cache_memory_bytes=8 << 20, async_scheduling=True)
    engine = tiny_llm.llm_engine
    regex = "[a-c]{3}"
    free = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    try:
        engine.reasoning_markers = MARKERS
        # the model writes the reasoning end at once: the rest follows the grammar
        forced = SamplingParams(
            max_tokens=20, temperature=0, logits_processors=[_force("</think>")], structured_outputs={"regex": regex}
        )
        # reasoning never ends (a random model does not write the marker): the grammar never applies
        open_ = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, structured_outputs={"regex": regex})
        outs = tiny_llm.generate(["q<think>", "q<think>", "<think></think>"], [forced, open_, open_], use_tqdm=False)
        unconstrained = tiny_llm.generate(["q<think>"], free, use_tqdm=False)[0].outputs[0].text
    finally:
        engine.reasoning_markers = None
    text = outs[0].outputs[0].text
    assert text.startswith(END) and re.fullmatch(regex, text[len(END) :]), text
    assert outs[1].outputs[0].text == unconstrained and END not in unconstrained
    assert re.fullmatch(regex, outs[2].outputs[0].text)  # the prompt closed the reasoning: constrained at once
