"""Grammar masks for draft tokens (speculative decoding), on both backends, against a plain re-implementation: a
fresh matcher per position, fed the request's tokens and the drafts before that position one by one. Drafts are cut
at the first token the grammar refuses, the k + 1 masks are those of each position, and the request's matcher is
left where it was (rolled back)."""

from __future__ import annotations

import numpy as np
import pytest
from char_tokenizer import EOS_ID, MODEL_VOCAB, char_tokenizer

from pagedllm import StructuredOutputsParams
from pagedllm.structured_output import StructuredOutputManager, fill_bitmasks, validate_drafts

CONSTRAINTS = {
    "json": dict(
        json={
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"enum": ["xy", "z"]}},
            "required": ["a", "b"],
        },
        disable_any_whitespace=True,
    ),
    "regex": dict(regex=r"(ab|c)+[0-9]{2}"),
    "choice": dict(choice=["abcab", "abd", "zz"]),
}


@pytest.fixture(scope="module", params=["xgrammar", "guidance"])
def manager(request) -> StructuredOutputManager:
    pytest.importorskip("xgrammar" if request.param == "xgrammar" else "llguidance")
    return StructuredOutputManager(char_tokenizer(), MODEL_VOCAB, [EOS_ID], default_backend=request.param)


def new_grammar(manager, kind: str, tokens: list[int]):
    grammar = manager.request_grammar(manager.grammar(StructuredOutputsParams(**CONSTRAINTS[kind])))
    grammar.compiled.result()
    assert grammar.accept(tokens) == len(tokens)
    return grammar


def allowed_set(words: np.ndarray) -> set[int]:
    bits = np.unpackbits(np.ascontiguousarray(words).view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits[:MODEL_VOCAB]).tolist())


def reference(manager, kind: str, tokens: list[int], drafts: list[int]) -> tuple[int, list[set[int]]]:
    """(how many drafts a fresh matcher takes one at a time, the allowed set at each position up to the one after
    the last taken draft: every token after the grammar's end)."""
    grammar = new_grammar(manager, kind, tokens)
    masks, taken = [], 0
    for token in [*drafts, None]:
        if grammar.is_terminated():
            masks.append(set(range(MODEL_VOCAB)))
            break
        masks.append(allowed_set(fill_bitmasks({"r": grammar})["r"]))
        if token is None or grammar.accept([token]) != 1:
            break
        taken += 1
    return taken, masks


def walk(manager, kind: str, rng: np.random.Generator, length: int) -> list[int]:
    """A random token sequence the grammar takes (each a random allowed token), up to length or the grammar's end."""
    grammar, tokens = new_grammar(manager, kind, []), []
    while len(tokens) < length and not grammar.is_terminated():
        token = int(rng.choice(sorted(allowed_set(fill_bitmasks({"r": grammar})["r"]))))
        assert grammar.accept([token]) == 1
        tokens.append(token)
    return tokens


def tok(text: str) -> list[int]:
    return char_tokenizer()(text)["input_ids"]


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_masks_per_draft_position_match_a_fresh_matcher(manager, kind):
    rng = np.random.default_rng(len(kind))
    num_cut = 0
    for trial in range(12):
        sequence = walk(manager, kind, rng, 14)
        split = int(rng.integers(0, len(sequence)))
        tokens, drafts = sequence[:split], sequence[split : split + 5]
        if trial % 2 and drafts:  # a corrupted draft: the grammar may refuse it and those after it
            pos = int(rng.integers(0, len(drafts)))
            drafts[pos] = int(rng.integers(0, MODEL_VOCAB))  # maybe an id past the tokenizer's (a draft model's)
        grammar = new_grammar(manager, kind, tokens)
        before = allowed_set(fill_bitmasks({"r": grammar})["r"])
        kept = validate_drafts(grammar, drafts)
        taken, expected = reference(manager, kind, tokens, drafts)
        assert kept == drafts[:taken]
        num_cut += taken < len(drafts)
        masks = fill_bitmasks({"r": grammar, "free": new_grammar(manager, kind, [])}, {"r": kept})
        assert masks["r"].shape == (len(kept) + 1, (MODEL_VOCAB + 31) // 32) and masks["free"].ndim == 1
        assert [allowed_set(m) for m in masks["r"]] == expected[: len(kept) + 1]
        # the request's own matcher was rolled back: same mask, and it still takes the drafts
        assert allowed_set(fill_bitmasks({"r": grammar})["r"]) == before
        assert grammar.accept(kept) == len(kept)
    assert num_cut >= 2  # corrupted drafts were cut (never a vacuous pass)


def test_drafts_after_the_end_are_cut_and_the_next_mask_allows_all(manager):
    """A draft that ends the grammar (EOS) is kept; drafts after it are cut; the position after it is never emitted
    (the request ends), its mask allows everything."""
    grammar = new_grammar(manager, "choice", tok("ab"))
    drafts = tok("d") + [EOS_ID] + tok("zz")
    kept = validate_drafts(grammar, drafts)
    assert kept == tok("d") + [EOS_ID]
    masks = [allowed_set(m) for m in fill_bitmasks({"r": grammar}, {"r": kept})["r"]]
    assert masks == [set(tok("cd")), {EOS_ID}, set(range(MODEL_VOCAB))]
    assert not grammar.is_terminated() and allowed_set(fill_bitmasks({"r": grammar})["r"]) == set(tok("cd"))


def test_draft_ids_past_the_tokenizer_are_cut_and_the_matcher_lives(manager):
    """A draft model may propose ids the model has but the tokenizer lacks (97..127 here): they are refused, and
    the matcher goes on (llguidance's would be left failed for good by such an id)."""
    grammar = new_grammar(manager, "regex", tok("ab"))
    for bad in (EOS_ID + 1, MODEL_VOCAB - 1):
        assert validate_drafts(grammar, tok("c") + [bad] + tok("ab")) == tok("c")
        assert [allowed_set(m) for m in fill_bitmasks({"r": grammar}, {"r": tok("c")})["r"]] == [
            set(tok("ac0123456789")),
            set(tok("ac0123456789")),
        ]
    assert grammar.accept(tok("c12") + [EOS_ID]) == 4 and grammar.is_terminated()


def test_reasoning_gate_masks_start_after_the_end_marker(manager):
    """With a reasoning section, positions before its end allow every token; the grammar applies from the draft
    after the end marker on, and the rollback puts the request back inside its reasoning."""
    end = tuple(tok("</t>"))
    params = StructuredOutputsParams(**CONSTRAINTS["regex"])
    grammar = manager.request_grammar(manager.grammar(params), [], (tuple(tok("<t>")), end))
    grammar.compiled.result()
    assert grammar.accept(tok("hm</t")) == 5
    drafts = tok(">ab") + tok("x")
    kept = validate_drafts(grammar, drafts)
    assert kept == tok(">ab")
    masks = [allowed_set(m) for m in fill_bitmasks({"r": grammar}, {"r": kept})["r"]]
    assert masks == [set(range(MODEL_VOCAB)), set(tok("ac")), set(tok("b")), set(tok("ac0123456789"))]
    assert not grammar.active and allowed_set(fill_bitmasks({"r": grammar})["r"]) == set(range(MODEL_VOCAB))
