"""StructuredOutputManager: one per engine. Checks a request's constraint when it is added (size and depth limits,
then a parse: a bad schema, regex or grammar is a ValueError at once), compiles each distinct constraint once on a
worker thread (cached by its kind and text), and gives each request its own RequestGrammar.

The scheduler keeps a request waiting until its grammar is compiled, asks each constrained request that samples in
a step for its allowed-token bitmask, and hands it the sampled tokens; the request finishes when its grammar
terminates."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from pagedllm.sampling_params import GuidedDecodingParams

MAX_SPEC_CHARS = 64 * 1024  # a schema's JSON text, a regex, a grammar, or all choices together
MAX_SCHEMA_DEPTH = 32  # nesting of a JSON schema's objects and arrays
MAX_CHOICES = 1024
MAX_CACHED_GRAMMARS = 256  # compiled grammars kept (least recently used dropped)


def _depth(value: object) -> int:
    """Nesting depth of a JSON value, iteratively (a deep schema never recurses in Python)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if d > MAX_SCHEMA_DEPTH:
                return d
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def spec_text(params: GuidedDecodingParams, field: str) -> str:
    """The constraint's text (a schema as compact JSON), checked against the size and depth limits."""
    kind = params.kind
    value = getattr(params, kind)
    if kind == "json":
        schema = value
        if isinstance(value, str):
            if len(value) > MAX_SPEC_CHARS:
                raise ValueError(f"{field}.json is {len(value)} characters long: at most {MAX_SPEC_CHARS}")
            try:
                schema = json.loads(value)
            except (ValueError, RecursionError) as e:
                raise ValueError(f"{field}.json is not valid JSON: {e}") from None
        depth = _depth(schema)
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"{field}.json nests deeper than {MAX_SCHEMA_DEPTH} levels")
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"{field}.json must be a JSON schema (an object), not {type(schema).__name__}")
        try:
            text = json.dumps(schema)  # key order kept: it is the order properties are written in
        except (TypeError, ValueError) as e:
            raise ValueError(f"{field}.json is not JSON data: {e}") from None
    elif kind == "choice":
        if len(value) > MAX_CHOICES:
            raise ValueError(f"{field}.choice holds {len(value)} choices: at most {MAX_CHOICES}")
        text = json.dumps(value)
    elif kind == "json_object":
        text = ""
    else:
        text = value
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"{field}.{kind} is {len(text)} characters long: at most {MAX_SPEC_CHARS}")
    return text


class RequestGrammar:
    """A request's grammar: its compilation (shared, maybe still running) and, once compiled, its own matcher.

    With `start_after` (the token ids that end a reasoning section, e.g. `</think>`), the grammar applies only after
    the output holds them: until then every token is allowed and the tokens are only watched for that end."""

    def __init__(self, backend, compiled: Future, start_after: tuple[int, ...] | None = None) -> None:
        self.backend = backend
        self.compiled = compiled
        self.state = None  # GrammarState, made on first use
        self.start_after = start_after
        self.before: list[int] = []  # the output tokens before the grammar started (the reasoning and its end)
        self.active = not start_after  # whether the grammar applies now
        self.num_accepted = 0  # tokens the matcher took (rollback needs to know where the grammar started)

    def ready(self) -> bool:
        return self.compiled.done()

    def error(self) -> BaseException | None:
        return self.compiled.exception() if self.compiled.done() else None

    def _state(self):
        if self.state is None:
            self.state = self.backend.matcher(self.compiled.result())
        return self.state

    def accept(self, token_ids: list[int]) -> int:
        """Takes tokens in order until the grammar refuses one; returns how many were taken."""
        i = 0
        while not self.active and i < len(token_ids):
            self.before.append(token_ids[i])
            i += 1
            self.active = tuple(self.before[-len(self.start_after) :]) == self.start_after
        if i == len(token_ids):
            return i
        taken = self._state().accept(token_ids[i:])
        self.num_accepted += taken
        return i + taken

    def rollback(self, num_tokens: int) -> None:
        from_grammar = min(num_tokens, self.num_accepted)
        if from_grammar:
            self._state().rollback(from_grammar)
        self.num_accepted -= from_grammar
        rest = num_tokens - from_grammar
        if rest:  # back into the reasoning: its end is no longer in the output
            del self.before[len(self.before) - rest :]
            self.active = False

    def is_terminated(self) -> bool:
        return self.active and self._state().is_terminated()

    def is_completed(self) -> bool:
        """Whether the tokens so far form a complete output (the grammar may end here)."""
        return self.active and self._state().matcher.is_completed()

    def fill_bitmask(self, out, row: int) -> None:
        """The allowed next tokens in out[row]; a fresh row allows all, as it stays while reasoning."""
        if self.active:
            self._state().fill_bitmask(out, row)


def reasoning_ended(prompt_token_ids: list[int], start_ids: tuple[int, ...], end_ids: tuple[int, ...]) -> bool:
    """Whether the prompt already closed its reasoning: the end marker after the last start marker (a template
    that turns thinking off writes both, e.g. `<think>\n\n</think>`)."""
    last_start, last_end = _rfind(prompt_token_ids, start_ids), _rfind(prompt_token_ids, end_ids)
    return last_end >= 0 and last_end > last_start


def _rfind(ids: list[int], part: tuple[int, ...]) -> int:
    """The last index where `part` starts in `ids`, else -1."""
    n = len(part)
    if n == 0:
        return -1
    first = part[0]
    for i in range(len(ids) - n, -1, -1):
        if ids[i] == first and tuple(ids[i : i + n]) == part:
            return i
    return -1


def fill_bitmasks(grammars: dict[str, RequestGrammar]) -> dict[str, np.ndarray]:
    """The allowed-token bitmask of each constrained request that samples now: req id -> int32 [num_words]."""
    if not grammars:
        return {}
    from pagedllm.structured_output.xgrammar_backend import new_bitmask

    first = next(iter(grammars.values()))
    tensor, array = new_bitmask(len(grammars), first.backend.num_words)  # [num_rows, num_words]
    for row, grammar in enumerate(grammars.values()):
        grammar.fill_bitmask(tensor, row)
    return dict(zip(grammars, array))


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        try:
            from pagedllm.structured_output.xgrammar_backend import XgrammarBackend
        except ImportError:
            raise ValueError(
                "structured outputs need the xgrammar package: pip install 'pagedllm[structured]'"
            ) from None
        self.backend = XgrammarBackend(tokenizer, vocab_size, stop_token_ids)
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pagedllm-grammar")
        self.cache: OrderedDict[tuple[str, str, bool], Future] = OrderedDict()
        self.lock = threading.Lock()  # requests may be added from several threads (the server's)

    def grammar(self, params: GuidedDecodingParams, field: str = "structured_outputs") -> Future:
        """The compiled grammar of a constraint (a Future: compiling runs on the worker thread). Raises ValueError
        at once for a constraint over the limits or one that does not parse."""
        text = spec_text(params, field)
        key = (params.kind, text, params.disable_any_whitespace)
        with self.lock:
            future = self.cache.get(key)
            if future is not None and not (future.done() and future.exception() is not None):
                self.cache.move_to_end(key)
                return future
        grammar = self.backend.parse(params, text, field)
        future = self.pool.submit(self.backend.compile, grammar)
        with self.lock:
            self.cache[key] = future
            while len(self.cache) > MAX_CACHED_GRAMMARS:
                self.cache.popitem(last=False)
        return future

    def request_grammar(
        self, compiled: Future, prompt_token_ids: list[int] = (), reasoning: tuple | None = None
    ) -> RequestGrammar:
        """A request's own matcher. reasoning = (start ids, end ids) of a reasoning section: the grammar starts
        after the output's end marker, unless the prompt already ended the reasoning."""
        if reasoning is None or reasoning_ended(list(prompt_token_ids), *reasoning):
            return RequestGrammar(self.backend, compiled)
        return RequestGrammar(self.backend, compiled, tuple(reasoning[1]))
