"""StructuredOutputManager: one per engine. Checks a request's constraint when it is added (size and depth limits,
then a parse: a bad schema, regex or grammar is a ValueError at once), compiles each distinct constraint once on a
worker thread (cached by its backend, kind and text), and gives each request its own RequestGrammar.

Backends (vLLM's names): "xgrammar", "guidance" (llguidance) and "auto": xgrammar, falling back to guidance where
xgrammar refuses the constraint (its parse fails: e.g. a JSON schema feature it lacks) or fails to compile it, and
guidance for a JSON `whitespace_pattern` or a Lark grammar (vLLM's rule: one without `::=`; xgrammar reads GBNF
only). With both failing, xgrammar's error.

The scheduler keeps a request waiting until its grammar is compiled, asks each constrained request that samples in
a step for its allowed-token bitmask, and hands it the sampled tokens; the request finishes when its grammar
terminates. With speculative decoding, a constrained request's drafts are cut at the first its grammar refuses when
they are proposed (validate_drafts), and a request verifying k drafts gets k + 1 masks, one per position
(fill_draft_bitmasks); its grammar takes only the tokens the verification emits."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import torch

from pagedllm.sampling_params import GuidedDecodingParams

MAX_SPEC_CHARS = 64 * 1024  # a schema's JSON text, a regex, a grammar, or all choices together
MAX_SCHEMA_DEPTH = 32  # nesting of a JSON schema's objects and arrays
MAX_CHOICES = 1024
MAX_CACHED_GRAMMARS = 256  # compiled grammars kept (least recently used dropped)
# free JSON whitespace: at most this many characters between two tokens of the JSON (pretty-printing to depth 4 at
# indent 4 fits); unbounded, a model can emit newlines until max_tokens and never finish the object
MAX_JSON_WHITESPACE = 16
BACKENDS = ("auto", "xgrammar", "guidance")
_PACKAGES = {"xgrammar": "xgrammar", "guidance": "llguidance"}
MIN_BATCH_FILL = 4  # constrained rows of one backend from which their bitmasks are filled in parallel


def is_lark(grammar: str) -> bool:
    """vLLM's rule: a grammar without `::=` is Lark (`start: ...`, `?rule: ...`), one with it is GBNF / EBNF."""
    return "::=" not in grammar


def check_backend(value: object, field: str) -> None:
    if value not in BACKENDS:
        raise ValueError(f"{field}={value!r} is not a structured output backend: one of {', '.join(BACKENDS)}")


class Compiled(NamedTuple):
    """A compiled constraint and the backend that compiled it (what a Future of the manager resolves to)."""

    backend: Any
    grammar: Any


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

    def __init__(self, num_words: int, compiled: Future, start_after: tuple[int, ...] | None = None) -> None:
        self.num_words = num_words  # packed int32 words of a bitmask row
        self.compiled = compiled  # Future of a Compiled
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
            backend, grammar = self.compiled.result()
            self.state = backend.matcher(grammar)
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
        return self.active and self._state().is_completed()

    def batch_filler(self):
        """The state's parallel bitmask filler (xgrammar's BatchGrammarMatcher), if the grammar applies now and its
        backend has one; else None (fill_bitmask fills the row)."""
        return getattr(self._state(), "batch", None) if self.active else None

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


class MaskBuffers:
    """The host arrays a filler's masks are written into, NUM_BUFFERS in turn (a step's masks are uploaded before the
    fill two steps later starts), in pinned memory where CUDA is: their upload then needs no staging copy (a fresh
    pinned copy of 64 rows of a 128k vocab cost ~1.5 ms of host time a step on an H100 host)."""

    NUM_BUFFERS = 3

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self.buffers: list[torch.Tensor | None] = [None] * self.NUM_BUFFERS  # each [capacity rows, words] int32
        self.next = 0

    def take(self, rows: int, words: int) -> np.ndarray:
        """An int32 [rows, words] array (contents undefined) whose row views have it as their base."""
        buf = self.buffers[self.next]
        if buf is None or buf.shape[1] != words or buf.shape[0] < rows:
            buf = torch.empty((max(rows, 64), words), dtype=torch.int32, pin_memory=self.pinned)
            self.buffers[self.next] = buf
        self.next = (self.next + 1) % self.NUM_BUFFERS
        return buf[:rows].numpy()


def fill_bitmasks(
    grammars: dict, drafts: dict[str, list[int]] | None = None, buffers: MaskBuffers | None = None
) -> dict[str, np.ndarray]:
    """The allowed-token bitmasks of the constrained requests that sample now: req id -> int32 [num_words], or for a
    request verifying k drafts (in `drafts`) int32 [k + 1, num_words], row i the mask after its tokens and drafts[:i]
    (fill_draft_bitmasks). buffers: where the masks are written (else a new array)."""
    if not grammars:
        return {}
    drafts = drafts or {}
    num_words = next(iter(grammars.values())).num_words
    counts = [len(drafts.get(req_id, ())) + 1 for req_id in grammars]
    # [num_rows, num_words]; -1: all allowed. Filled by numpy: torch.full this size would wait for torch's intra-op
    # threads, which a CPU forward running meanwhile holds
    if buffers is None:
        array = np.full((sum(counts), num_words), -1, dtype=np.int32)
    else:
        array = buffers.take(sum(counts), num_words)
        array.fill(-1)
    tensor = torch.from_numpy(array)
    masks, row = {}, 0
    batches: dict[int, tuple[Any, list, list[int]]] = {}  # id(filler) -> (filler, states, rows): one mask each
    for (req_id, grammar), n in zip(grammars.items(), counts):
        filler = None if req_id in drafts else grammar.batch_filler()
        if req_id in drafts:
            fill_draft_bitmasks(grammar, drafts[req_id], tensor, row)
        elif filler is None:
            grammar.fill_bitmask(tensor, row)
        else:
            _, states, rows = batches.setdefault(id(filler), (filler, [], []))
            states.append(grammar.state)
            rows.append(row)
        masks[req_id] = array[row : row + n] if req_id in drafts else array[row]
        row += n
    for filler, states, rows in batches.values():
        if len(rows) >= MIN_BATCH_FILL:
            filler.fill(states, rows, tensor)
        else:
            for state, row in zip(states, rows):
                state.fill_bitmask(tensor, row)
    return masks


class PendingBitmasks(Mapping):
    """A step's bitmasks (req id -> mask, as fill_bitmasks returns) being filled on the filler's thread while the
    step's forward is queued and runs: the runner reads them only for its sampler, after launching the forward.
    Deferred (async scheduling, a constrained row's last token still on the device): not filled until the engine has
    the previous step's tokens and calls BitmaskFiller.start; the runner then launches the forward alone and samples
    when the engine asks. Pickled for another rank it is an empty dict: only the driver rank samples."""

    pending = True

    def __init__(self, future: Future | None, req_ids: list[str], grammars: dict | None = None) -> None:
        self.future, self.req_ids = future, req_ids
        self.grammars = grammars  # deferred: the grammars to fill from once started (None: started)

    @property
    def deferred(self) -> bool:
        return self.future is None

    def __getitem__(self, req_id: str) -> np.ndarray:
        return self.result()[req_id]

    def get(self, req_id: str, default=None):
        return self.result().get(req_id, default)  # (no KeyError raised and caught for each unmasked row)

    def result(self) -> dict[str, np.ndarray]:
        """The masks, once filled (waits for the filler)."""
        if self.future is None:
            raise RuntimeError("grammar bitmasks read before they were filled")
        return self.future.result()

    def __iter__(self):
        return iter(self.req_ids)

    def __len__(self) -> int:
        return len(self.req_ids)

    def __bool__(self) -> bool:
        return bool(self.req_ids)

    def __reduce__(self):
        return dict, ()


class BitmaskFiller:
    """Fills each step's bitmasks on one thread of its own (not the grammar compiler's, which a slow compile may
    hold): the scheduler hands the step over and returns; the runner waits for the masks right before sampling."""

    def __init__(self) -> None:
        self.pool: ThreadPoolExecutor | None = None
        self.buffers = MaskBuffers(pinned=torch.cuda.is_available())

    def submit(self, grammars: dict, drafts: dict[str, list[int]], defer: bool = False) -> PendingBitmasks | dict:
        """The step's masks, filled from now on (defer: from start(), once their grammars are current)."""
        if not grammars:
            return {}
        if defer:
            return PendingBitmasks(None, list(grammars), grammars)
        return PendingBitmasks(self._submit(grammars, drafts), list(grammars))

    def start(self, masks: PendingBitmasks, keep) -> None:
        """Fills deferred masks from their grammars as they are now, for the requests keep(req_id) names (the others
        ended: their rows allow every token, and their tokens are dropped)."""
        grammars = {r: g for r, g in masks.grammars.items() if keep(r)}
        masks.future, masks.grammars = self._submit(grammars, {}), None

    def _submit(self, grammars: dict, drafts: dict[str, list[int]]) -> Future:
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-bitmask")
        return self.pool.submit(fill_bitmasks, grammars, drafts, self.buffers)


def validate_drafts(grammar, drafts: list[int]) -> list[int]:
    """The leading drafts the grammar takes after the request's tokens: up to the first it refuses, none after one
    that ends it. (A refused draft could never be accepted: the target token at its position is masked.) The
    matcher is left where it was."""
    taken = grammar.accept(drafts)
    grammar.rollback(taken)
    return drafts[:taken]


def fill_draft_bitmasks(grammar, drafts: list[int], out: torch.Tensor, row: int) -> None:
    """out[row + i], i = 0..k: the tokens allowed after the request's tokens and drafts[:i] (the matcher advanced over
    the drafts, then rolled back). Rows after a draft the grammar refuses, or after it terminated, stay as they are
    (all allowed): no token is emitted there (the target token at a refused draft's position differs from it; a
    terminated grammar ends its request)."""
    taken = 0
    for i in range(len(drafts) + 1):
        if grammar.is_terminated():
            break
        grammar.fill_bitmask(out, row + i)
        if i == len(drafts) or grammar.accept(drafts[i : i + 1]) != 1:
            break
        taken += 1
    grammar.rollback(taken)


class StructuredOutputManager:
    """default_backend: the engine's `guided_decoding_backend`, for requests that name none."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], default_backend: str = "auto") -> None:
        check_backend(default_backend, "guided_decoding_backend")
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, list(stop_token_ids)
        self.num_words = (vocab_size + 31) // 32
        self.default_backend = default_backend
        self.backends: dict[str, Any] = {}  # name -> backend, made on first use
        self.backend_locks = {name: threading.Lock() for name in _PACKAGES}
        self.unusable: dict[str, str] = {}  # name -> why the backend could not be built
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pagedllm-grammar")
        self.cache: OrderedDict[tuple, Future] = OrderedDict()
        self.lock = threading.Lock()  # requests may be added from several threads (the server's)
        if default_backend != "auto":
            self.get_backend(default_backend)  # a missing package or an unusable tokenizer fails here, at once

    @property
    def backend(self):
        """The default backend (xgrammar for "auto")."""
        return self.get_backend("xgrammar" if self.default_backend == "auto" else self.default_backend)

    def available(self, name: str) -> bool:
        try:
            self.get_backend(name)
        except ValueError:
            return False
        return True

    def get_backend(self, name: str):
        """The backend, built on first use; ValueError where its package is missing or it cannot read the tokenizer
        (remembered: not tried again)."""
        backend = self.backends.get(name)
        if backend is None:
            with self.backend_locks[name]:  # one lock a backend: building one does not hold up the other
                if name in self.unusable:
                    raise ValueError(self.unusable[name])
                try:
                    backend = self.backends.get(name) or self.backends.setdefault(name, self._make_backend(name))
                except ValueError as e:
                    self.unusable[name] = str(e)
                    raise
        return backend

    def _make_backend(self, name: str):
        try:
            if name == "xgrammar":
                from pagedllm.structured_output.xgrammar_backend import XgrammarBackend as cls
            else:
                from pagedllm.structured_output.guidance_backend import GuidanceBackend as cls
        except ImportError:
            raise ValueError(_missing(name)) from None
        return cls(self.tokenizer, self.vocab_size, self.stop_token_ids)

    def choose(self, params: GuidedDecodingParams) -> str:
        """The backend a constraint asks for: its own `backend`, else the engine's default."""
        name = params.backend or self.default_backend
        if params.whitespace_pattern is not None:
            if name == "xgrammar":
                raise ValueError("whitespace_pattern is not supported by the xgrammar backend: use 'guidance'")
            return "guidance"
        return name

    def grammar(self, params: GuidedDecodingParams, field: str = "structured_outputs") -> Future:
        """The compiled grammar of a constraint (a Future of a Compiled: compiling runs on the worker thread).
        Raises ValueError at once for a constraint over the limits or one that does not parse."""
        text = spec_text(params, field)
        name = self.choose(params)
        key = (name, params.kind, text, params.disable_any_whitespace, params.whitespace_pattern)
        with self.lock:
            future = self.cache.get(key)
            if future is not None and not (future.done() and future.exception() is not None):
                self.cache.move_to_end(key)
                return future
        if name == "auto":
            future = self._auto(params, text, field)
        else:
            future = self.pool.submit(self._compile, name, self.get_backend(name).parse(params, text, field))
        with self.lock:
            self.cache[key] = future
            while len(self.cache) > MAX_CACHED_GRAMMARS:
                self.cache.popitem(last=False)
        return future

    def _auto(self, params: GuidedDecodingParams, text: str, field: str) -> Future:
        """xgrammar, or guidance where xgrammar is missing, refuses the constraint or fails to compile it. (Only
        guidance's parse runs here; its backend, slow to build the first time, is made on the worker thread.)"""

        def guidance() -> str:  # the parsed grammar; ValueError where guidance cannot read it either
            return _guidance_parse(params, text, field)

        if not self.available("xgrammar") or (params.kind == "grammar" and is_lark(text)):  # xgrammar reads no Lark
            return self.pool.submit(self._compile, "guidance", guidance())
        try:
            grammar = self.get_backend("xgrammar").parse(params, text, field)
        except ValueError as error:
            try:
                parsed = guidance()
            except ValueError:
                raise error from None
            return self.pool.submit(self._compile, "guidance", parsed)
        return self.pool.submit(self._compile_or_fall_back, grammar, guidance)

    def _compile(self, name: str, grammar) -> Compiled:
        backend = self.get_backend(name)
        return Compiled(backend, backend.compile(grammar))

    def _compile_or_fall_back(self, grammar, guidance) -> Compiled:
        """With "auto", on the worker thread: xgrammar's compilation, where it fails guidance's (else xgrammar's
        error)."""
        try:
            return self._compile("xgrammar", grammar)
        except Exception as error:
            try:
                parsed = guidance()
            except ValueError:
                raise error from None
            return self._compile("guidance", parsed)

    def request_grammar(
        self, compiled: Future, prompt_token_ids: list[int] = (), reasoning: tuple | None = None
    ) -> RequestGrammar:
        """A request's own matcher. reasoning = (start ids, end ids) of a reasoning section: the grammar starts
        after the output's end marker, unless the prompt already ended the reasoning."""
        if reasoning is None or reasoning_ended(list(prompt_token_ids), *reasoning):
            return RequestGrammar(self.num_words, compiled)
        return RequestGrammar(self.num_words, compiled, tuple(reasoning[1]))


def _guidance_parse(params: GuidedDecodingParams, text: str, field: str) -> str:
    try:
        from pagedllm.structured_output.guidance_backend import parse
    except ImportError:
        raise ValueError(_missing("guidance")) from None
    return parse(params, text, field)


def _missing(name: str) -> str:
    extra = "structured" if name == "xgrammar" else "guidance"
    return f"the {name} structured output backend needs the {_PACKAGES[name]} package: pip install 'pagedllm[{extra}]'"
