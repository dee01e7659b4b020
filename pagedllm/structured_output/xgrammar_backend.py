"""The xgrammar backend: a constraint becomes an xgrammar Grammar (parsed at once, so a bad one is refused when the
request is added), a CompiledGrammar (the token-level tables, compiled on a worker thread), and per request a
GrammarMatcher that takes the sampled tokens and fills the packed allowed-token bitmask of the next one.

A JSON schema's length-bounded strings are rewritten into an equivalent grammar whose masks are precomputed
(bounded_strings.py), and xgrammar sees only the tokenizer's ids (rounded up to a word), not a model's padded vocab:
the words past them are zero in every filled row (filling them costs ~0.1 ms a row for a 128k vocab)."""

from __future__ import annotations

import json
import os
import re

import torch
import xgrammar as xgr

from pagedllm.sampling_params import GuidedDecodingParams
from pagedllm.structured_output import bounded_strings
from pagedllm.structured_output.manager import MAX_JSON_WHITESPACE, is_lark

MAX_FILL_THREADS = 8  # threads filling a step's masks at most

# where xgrammar's error text starts: its messages begin with "[time] /path/file.cc:line: "
_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+\.cc:\d+:\s*")


def _message(error: Exception) -> str:
    text = str(error).strip()
    return _CPP_PREFIX.sub("", text).split("\n")[0][:500]


class XgrammarBackend:
    """One per engine: the tokenizer's vocabulary as xgrammar sees it (the model's ids past it are never allowed),
    and a compiler shared by all requests."""

    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], num_threads: int = 2) -> None:
        fill_vocab = matcher_vocab_size(tokenizer, vocab_size, stop_token_ids)
        try:
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=fill_vocab, stop_token_ids=stop_token_ids)
        except Exception as e:  # e.g. a tokenizer with more tokens than the model's vocab
            raise ValueError(f"structured outputs: the tokenizer is not usable by xgrammar: {_message(e)}") from e
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32  # packed int32 words per bitmask row
        self.fill_words = (fill_vocab + 31) // 32  # the leading words xgrammar fills; the rest stay zero
        # xgrammar's own cache has no size limit by default: the manager's bounded LRU of compiled grammars is the one
        self.compiler = xgr.GrammarCompiler(info, max_threads=num_threads, cache_enabled=False)
        self.batch = BatchFill(fill_threads())

    def parse(self, params: GuidedDecodingParams, spec: str, field: str) -> xgr.Grammar:
        """The constraint as a Grammar (fast; no tokenizer work). Raises ValueError naming the field."""
        kind = params.kind
        try:
            if kind in ("json", "json_object"):  # json_object: any object (the builtin JSON grammar takes any value)
                schema, strict = (spec, True) if kind == "json" else ('{"type": "object"}', False)
                flexible = not params.disable_any_whitespace  # else the separators ", " and ": " only
                grammar = xgr.Grammar.from_json_schema(
                    schema,
                    strict_mode=strict,
                    any_whitespace=flexible,
                    max_whitespace_cnt=MAX_JSON_WHITESPACE if flexible else None,
                )
                return _chain_bounded_strings(grammar)
            if kind == "regex":
                return xgr.Grammar.from_regex(spec)
            if kind == "choice":  # one alternative per choice, each a quoted literal (json.dumps escapes it)
                return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in params.choice))
            if kind == "grammar":
                if is_lark(spec):  # vLLM converts simple Lark for xgrammar; here guidance reads it
                    raise ValueError("it is a Lark grammar (no `::=`): xgrammar reads GBNF only; use guidance")
                return xgr.Grammar.from_ebnf(spec)
            return _structural_tag(spec)
        except Exception as e:
            raise ValueError(f"{field}.{kind} is invalid: {_message(e)}") from None

    def compile(self, grammar: xgr.Grammar) -> xgr.CompiledGrammar:
        return self.compiler.compile_grammar(grammar)

    def matcher(self, compiled: xgr.CompiledGrammar) -> GrammarState:
        return GrammarState(xgr.GrammarMatcher(compiled), self.fill_words, self.batch)


def matcher_vocab_size(tokenizer, vocab_size: int, stop_token_ids: list[int]) -> int:
    """The ids xgrammar is given: the tokenizer's (and the stop tokens), rounded up to a whole bitmask word, at most
    the model's vocab size."""
    ids = [len(tokenizer), *(i + 1 for i in tokenizer.get_vocab().values()), *(i + 1 for i in stop_token_ids)]
    return min(vocab_size, (max(ids) + 31) // 32 * 32)


def fill_threads(cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """Threads for a step's masks: half the cores this process may run on (its CPU affinity and cgroup v2 quota: a
    container's, not the host's, which xgrammar's own default counts), 1 to MAX_FILL_THREADS."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        with open(cpu_max) as f:  # "max 100000" or "<quota> <period>"
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(1, min(MAX_FILL_THREADS, cores // 2))


def _chain_bounded_strings(grammar: xgr.Grammar) -> xgr.Grammar:
    """The grammar with its length-bounded strings as chains of rules (bounded_strings.py); itself where it has none
    or the rewritten text does not parse."""
    text = str(grammar)
    chained = bounded_strings.rewrite(text)
    if chained == text:
        return grammar
    try:
        return xgr.Grammar.from_ebnf(chained)
    except Exception:  # a printed form this rewrite does not know: keep xgrammar's own grammar
        return grammar


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

    def __init__(self, matcher: xgr.GrammarMatcher, fill_words: int, batch: BatchFill) -> None:
        self.matcher = matcher
        self.fill_words = fill_words  # the leading words of a bitmask row that xgrammar fills
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
        if out.shape[1] == self.fill_words:
            self.matcher.fill_next_token_bitmask(out, row)
            return
        part = torch.empty((1, self.fill_words), dtype=torch.int32)  # xgrammar writes whole contiguous rows
        self.matcher.fill_next_token_bitmask(part, 0)
        _place(out, [row], part)


class BatchFill:
    """Fills many rows' bitmasks at once on xgrammar's threads: on a fast device a step of 64 constrained rows would
    otherwise wait for 64 fills one after another."""

    def __init__(self, num_threads: int) -> None:
        self.matcher = xgr.BatchGrammarMatcher(num_threads)

    def fill(self, states: list[GrammarState], rows: list[int], out: torch.Tensor) -> None:
        """out[rows[i]] = the allowed next tokens of states[i] (all of one backend: the same fill_words)."""
        matchers, words = [s.matcher for s in states], states[0].fill_words
        if out.shape[1] == words:
            self.matcher.batch_fill_next_token_bitmask(matchers, out, rows)
            return
        part = torch.empty((len(rows), words), dtype=torch.int32)  # [len(rows), fill_words]
        self.matcher.batch_fill_next_token_bitmask(matchers, part)
        _place(out, rows, part)


def _place(out: torch.Tensor, rows: list[int], part: torch.Tensor) -> None:
    """out[rows] = part ([len(rows), fill_words]) then zeros. Through numpy: a torch copy this size runs on torch's
    intra-op threads, which a CPU forward running meanwhile holds (milliseconds of waiting)."""
    array, words = out.numpy(), part.shape[1]
    if rows == list(range(rows[0], rows[0] + len(rows))):  # (the usual case: plain copies, not fancy indexing)
        rows = slice(rows[0], rows[0] + len(rows))
    array[rows, :words] = part.numpy()
    array[rows, words:] = 0
