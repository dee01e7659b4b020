"""The llguidance backend: a constraint becomes an llguidance grammar (its text, validated against the tokenizer at
once, so a bad one is refused when the request is added), an LLMatcher built on a worker thread (the token-level
parser: the slow part), and per request a copy of that matcher that takes the sampled tokens and fills the same
packed int32 allowed-token bitmask as the xgrammar backend.

Beyond xgrammar it reads Lark grammars (and GBNF), JSON schema features xgrammar refuses, and a JSON
`whitespace_pattern`; it has no structural tags. JSON schemas are read as xgrammar reads them (properties not
listed are not allowed unless the schema says so), so "auto" gives the same outputs whichever backend it takes."""

from __future__ import annotations

import json
import logging

import llguidance
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark

from pagedllm.sampling_params import GuidedDecodingParams
from pagedllm.structured_output.manager import MAX_JSON_WHITESPACE, is_lark

logger = logging.getLogger(__name__)
# free whitespace between JSON tokens, bounded as xgrammar's max_whitespace_cnt bounds it
_WHITESPACE = rf"[\x20\x0A\x0D\x09]{{1,{MAX_JSON_WHITESPACE}}}"


def _message(text: str) -> str:
    return str(text).strip().split("\n")[0][:500]


class GuidanceBackend:
    """One per engine: the tokenizer as llguidance sees it, padded to the model's vocab size (ids past the
    tokenizer's are never allowed)."""

    name = "guidance"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        try:
            self.tokenizer = _ll_tokenizer(tokenizer, vocab_size, stop_token_ids)
        except Exception as e:
            raise ValueError(f"structured outputs: the tokenizer is not usable by llguidance: {_message(e)}") from e
        self.vocab_size = vocab_size
        self.stop_token_ids = frozenset(stop_token_ids)
        self.num_words = (vocab_size + 31) // 32  # packed int32 words per bitmask row

    def parse(self, params: GuidedDecodingParams, spec: str, field: str) -> str:
        return parse(params, spec, field)

    def compile(self, grammar: str) -> llguidance.LLMatcher:
        """The grammar's parser in its start state: each request's matcher is a copy of it."""
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the grammar does not compile: {_message(matcher.get_error())}")
        return matcher

    def matcher(self, compiled: llguidance.LLMatcher) -> GuidanceState:
        return GuidanceState(compiled.deep_copy(), self.stop_token_ids, self.tokenizer.vocab_size)


def parse(params: GuidedDecodingParams, spec: str, field: str) -> str:
    """The constraint as llguidance grammar text, its syntax checked (fast; no tokenizer needed). Raises ValueError
    naming the field."""
    kind = params.kind
    if kind == "structural_tag":
        raise ValueError(f"{field}.structural_tag is not supported by the guidance backend: use xgrammar")
    try:
        grammar = _grammar(params, spec)
    except Exception as e:
        raise ValueError(f"{field}.{kind} is invalid: {_message(e)}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(f"{field}.{kind} is invalid: {_message(messages[0] if messages else 'error')}")
    return grammar


def _grammar(params: GuidedDecodingParams, spec: str) -> str:
    kind = params.kind
    if kind in ("json", "json_object"):
        if params.disable_any_whitespace:  # xgrammar's separators, so both backends write the same text
            options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        else:
            options = {"whitespace_flexible": True, "whitespace_pattern": params.whitespace_pattern or _WHITESPACE}
        schema = json.dumps(_strict(json.loads(spec))) if kind == "json" else '{"type": "object"}'
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":  # one alternative per choice, each a quoted literal (json.dumps escapes it)
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
    if is_lark(spec):  # said, not guessed: llguidance's guess takes a Lark grammar without `start:` for GBNF
        return llguidance.LLMatcher.grammar_from_lark(spec)
    return llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(spec))


def _ll_tokenizer(tokenizer, vocab_size: int, stop_token_ids: list[int]) -> llguidance.LLTokenizer:
    """llguidance reads a fast tokenizer's JSON; where it cannot (a decoder it does not know, a slow tokenizer), it
    gets each token's bytes instead."""
    import llguidance.hf

    try:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=stop_token_ids)
    except Exception:
        wrapper = llguidance.TokenizerWrapper(_TokenBytes(tokenizer, stop_token_ids))
        return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=stop_token_ids)


class _TokenBytes:
    """A tokenizer as llguidance's TokenizerWrapper wants it: each id's bytes, the special ids, and encode."""

    def __init__(self, tokenizer, stop_token_ids: list[int]) -> None:
        self.tok = tokenizer
        self.eos_token_id = stop_token_ids[0] if stop_token_ids else tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = list(tokenizer.all_special_ids)
        self.tokens = _decoded_vocab(tokenizer)

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self.tok.encode(text, add_special_tokens=False)


def _decoded_vocab(tokenizer) -> list[bytes]:
    """Each token id's bytes: xgrammar's reading of the vocabulary where it is installed (it knows byte-level and
    byte-fallback vocabularies), else each token decoded on its own."""
    try:
        import xgrammar as xgr

        return list(xgr.TokenizerInfo.from_huggingface(tokenizer).decoded_vocab)
    except Exception:
        return [tokenizer.decode([i]).encode("utf-8") for i in range(len(tokenizer))]


_DATA_KEYS = ("enum", "const", "default", "examples")  # their values are JSON data, not schemas


def _strict(schema):
    """The schema with additionalProperties false wherever it is not given, as xgrammar's strict mode reads it:
    both backends then accept the same objects (an object without its listed properties only)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            is_object = "properties" in node or node.get("type") == "object"
            if is_object and "additionalProperties" not in node and "unevaluatedProperties" not in node:
                node["additionalProperties"] = False
            stack.extend(v for k, v in node.items() if k not in _DATA_KEYS)
    return schema


class GuidanceState:
    """A request's position in its grammar: the tokens it accepted so far."""

    def __init__(self, matcher: llguidance.LLMatcher, stop_token_ids: frozenset[int], num_tokens: int) -> None:
        self.matcher = matcher
        self.stop_token_ids = stop_token_ids
        self.num_tokens = num_tokens  # the tokenizer's ids: llguidance fails for good on an id past them
        # llguidance "stops" where nothing but EOS may follow, and then refuses that EOS: it is taken here
        self.final_stop = False

    def accept(self, token_ids: list[int]) -> int:
        """Takes tokens in order until one is refused; returns how many were taken. (Checked first: a refused
        token would leave llguidance's matcher in its error state for good, as would validating an id past the
        tokenizer's, which a draft may be: those are refused here.)"""
        if self.final_stop:
            return 0
        tokens = list(token_ids)
        outside = next((i for i, t in enumerate(tokens) if not 0 <= t < self.num_tokens), None)
        if outside is not None:
            tokens = tokens[:outside]
        num_valid = self.matcher.validate_tokens(tokens)
        if num_valid and not self.matcher.consume_tokens(tokens[:num_valid]):
            # the matcher failed (e.g. its lexer outgrew llguidance's limits): refused, so only this request ends
            logger.warning("llguidance matcher failed: %s", _message(self.matcher.get_error()))
            return 0
        rest = tokens[num_valid:]
        if rest and rest[0] in self.stop_token_ids and self.matcher.is_stopped() and not self.matcher.is_error():
            self.final_stop = True
            return num_valid + 1
        return num_valid

    def rollback(self, num_tokens: int) -> None:
        """Forgets the last num_tokens accepted (draft tokens that verification rejected)."""
        if num_tokens and self.final_stop:
            self.final_stop, num_tokens = False, num_tokens - 1
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        """The grammar took a stop token (the EOS is sampled, as with xgrammar, so outputs end the same way)."""
        return self.final_stop or (self.matcher.is_stopped() and self.matcher.stop_reason() == "EndOfSentence")

    def is_completed(self) -> bool:
        return self.matcher.is_accepting()

    def fill_bitmask(self, out: torch.Tensor, row: int) -> None:
        """Writes the allowed next tokens into out[row] (int32 [rows, num_words], on the CPU)."""
        words = out[row]  # (llguidance.torch's helper would import torch._dynamo: seconds on first use)
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())
