"""The xgrammar backend: a constraint becomes an xgrammar Grammar (parsed at once, so a bad one is refused when the
request is added), a CompiledGrammar (the token-level tables, compiled on a worker thread), and per request a
GrammarMatcher that takes the sampled tokens and fills the packed allowed-token bitmask of the next one."""

from __future__ import annotations

import json
import re

import torch
import xgrammar as xgr

from pagedllm.sampling_params import GuidedDecodingParams
from pagedllm.structured_output.manager import MAX_JSON_WHITESPACE

# where xgrammar's error text starts: its messages begin with "[time] /path/file.cc:line: "
_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+\.cc:\d+:\s*")


def _message(error: Exception) -> str:
    text = str(error).strip()
    return _CPP_PREFIX.sub("", text).split("\n")[0][:500]


class XgrammarBackend:
    """One per engine: the tokenizer's vocabulary as xgrammar sees it, padded to the model's vocab size (the ids
    past the tokenizer's are never allowed), and a compiler shared by all requests."""

    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], num_threads: int = 2) -> None:
        try:
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        except Exception as e:  # e.g. a tokenizer with more tokens than the model's vocab
            raise ValueError(f"structured outputs: the tokenizer is not usable by xgrammar: {_message(e)}") from e
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32  # packed int32 words per bitmask row
        # xgrammar's own cache has no size limit by default: the manager's bounded LRU of compiled grammars is the one
        self.compiler = xgr.GrammarCompiler(info, max_threads=num_threads, cache_enabled=False)
        self.batch = BatchFill()

    def parse(self, params: GuidedDecodingParams, spec: str, field: str) -> xgr.Grammar:
        """The constraint as a Grammar (fast; no tokenizer work). Raises ValueError naming the field."""
        kind = params.kind
        try:
            if kind in ("json", "json_object"):  # json_object: any object (the builtin JSON grammar takes any value)
                schema, strict = (spec, True) if kind == "json" else ('{"type": "object"}', False)
                flexible = not params.disable_any_whitespace  # else the separators ", " and ": " only
                return xgr.Grammar.from_json_schema(
                    schema,
                    strict_mode=strict,
                    any_whitespace=flexible,
                    max_whitespace_cnt=MAX_JSON_WHITESPACE if flexible else None,
                )
            if kind == "regex":
                return xgr.Grammar.from_regex(spec)
            if kind == "choice":  # one alternative per choice, each a quoted literal (json.dumps escapes it)
                return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in params.choice))
            if kind == "grammar":
                return xgr.Grammar.from_ebnf(spec)
            return _structural_tag(spec)
        except Exception as e:
            raise ValueError(f"{field}.{kind} is invalid: {_message(e)}") from None

    def compile(self, grammar: xgr.Grammar) -> xgr.CompiledGrammar:
        return self.compiler.compile_grammar(grammar)

    def matcher(self, compiled: xgr.CompiledGrammar) -> GrammarState:
        return GrammarState(xgr.GrammarMatcher(compiled), self.num_words, self.batch)


def _structural_tag(spec: str) -> xgr.Grammar:
    """vLLM's structural tag ({"structures": [{"begin", "schema", "end"}], "triggers": [...]}) or xgrammar's own."""
    tag = json.loads(spec)
    if isinstance(tag, dict) and "structures" in tag:
        items = [
            xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
            for s in tag["structures"]
        ]
        return xgr.Grammar.from_structural_tag(items, tag["triggers"])
    return xgr.Grammar.from_structural_tag(spec)


class GrammarState:
    """A request's position in its grammar: the tokens it accepted so far."""

    def __init__(self, matcher: xgr.GrammarMatcher, num_words: int, batch: BatchFill) -> None:
        self.matcher = matcher
        self.num_words = num_words
        self.batch = batch  # the backend's: the rows of the states that share it are filled together

    def accept(self, token_ids: list[int]) -> int:
        """Takes tokens in order until one is rejected; returns how many were taken."""
        for i, token_id in enumerate(token_ids):
            if self.matcher.is_terminated() or not self.matcher.accept_token(token_id):
                return i
        return len(token_ids)

    def rollback(self, num_tokens: int) -> None:
        """Forgets the last num_tokens accepted (draft tokens that verification rejected)."""
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def is_completed(self) -> bool:
        """Whether the tokens so far form a complete output (the grammar may end here)."""
        return self.matcher.is_completed()

    def fill_bitmask(self, out: torch.Tensor, row: int) -> None:
        """Writes the allowed next tokens into out[row] (int32 [rows, num_words], on the CPU)."""
        self.matcher.fill_next_token_bitmask(out, row)


class BatchFill:
    """Fills many rows' bitmasks at once on xgrammar's threads (half the host's cores): on a fast device a step of
    64 constrained rows would otherwise wait for 64 fills one after another."""

    def __init__(self) -> None:
        self.matcher = xgr.BatchGrammarMatcher()

    def fill(self, states: list[GrammarState], rows: list[int], out: torch.Tensor) -> None:
        """out[rows[i]] = the allowed next tokens of states[i]."""
        self.matcher.batch_fill_next_token_bitmask([s.matcher for s in states], out, rows)
