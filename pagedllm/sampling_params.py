"""SamplingParams: how to pick each next token and when to stop, with vLLM's names and defaults."""

from __future__ import annotations

import copy
import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field

_SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20  # the most top logprobs a request may ask for (vLLM's default max_logprobs)


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is out of range: {allowed}")


class RequestOutputKind(enum.IntEnum):
    """What each streamed RequestOutput of a request carries (vLLM's values). CUMULATIVE: everything generated so
    far; DELTA: only what is new since the request's previous output (cumulative_logprob stays a running total,
    prompt_logprobs come once, in the first); FINAL_ONLY: no output until the request finishes, then the whole.
    LLM.generate returns whole final outputs whatever a request asks."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class GuidedDecodingParams:
    """One constraint on a request's output (structured outputs): a JSON schema, a regex, a list of choices, an
    EBNF grammar, any JSON object, or an xgrammar structural tag. vLLM's names; exactly one constraint is set."""

    json: str | dict | None = None  # a JSON schema (a dict, its JSON text, or a pydantic model class)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF) text
    json_object: bool | None = None
    structural_tag: str | None = None  # JSON text of an xgrammar structural tag
    disable_any_whitespace: bool = False  # JSON without free whitespace between tokens
    backend: str | None = None  # "xgrammar" | "guidance" | "auto"; None: the engine's guided_decoding_backend
    whitespace_pattern: str | None = None  # JSON whitespace regex (guidance backend only)

    def __post_init__(self) -> None:
        if isinstance(self.json, type) and hasattr(self.json, "model_json_schema"):
            self.json = self.json.model_json_schema()  # a pydantic model class
        given = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"{self._name()}: exactly one of {', '.join(_CONSTRAINTS)} must be set, not {given or 'none'}"
            )
        self._check_types()

    def _name(self) -> str:
        return "structured_outputs" if isinstance(self, StructuredOutputsParams) else "guided_decoding"

    def _check_types(self) -> None:
        field_ = self._name()
        _check(self.json is None or isinstance(self.json, (str, dict)), f"{field_}.json", self.json, "a dict or str")
        for name in ("regex", "grammar", "structural_tag"):
            v = getattr(self, name)
            _check(v is None or (isinstance(v, str) and v != ""), f"{field_}.{name}", v, "a non-empty str")
        c = self.choice
        ok = c is None or (isinstance(c, (list, tuple)) and len(c) > 0 and all(isinstance(x, str) for x in c))
        _check(ok, f"{field_}.choice", c, "a non-empty list of str")
        if c is not None:
            self.choice = list(c)
        _check(self.json_object in (None, True, False), f"{field_}.json_object", self.json_object, "a bool")
        _check(
            isinstance(self.disable_any_whitespace, bool),
            f"{field_}.disable_any_whitespace",
            self.disable_any_whitespace,
            "a bool",
        )
        _check(
            not self.disable_any_whitespace or self.kind in ("json", "json_object"),
            f"{field_}.disable_any_whitespace",
            self.disable_any_whitespace,
            "False unless the constraint is json or json_object",
        )
        _check(
            self.backend in (None, "auto", "xgrammar", "guidance"),
            f"{field_}.backend",
            self.backend,
            '"xgrammar", "guidance" or "auto"',
        )
        _check(
            self.whitespace_pattern is None
            or (isinstance(self.whitespace_pattern, str) and self.kind in ("json", "json_object")),
            f"{field_}.whitespace_pattern",
            self.whitespace_pattern,
            "None, or a str with a json or json_object constraint",
        )

    @property
    def kind(self) -> str:
        return next(name for name in _CONSTRAINTS if getattr(self, name) not in (None, False))


@dataclass
class StructuredOutputsParams(GuidedDecodingParams):
    """vLLM's current name for GuidedDecodingParams (SamplingParams.structured_outputs)."""


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    bad_words: list[str] | None = None
    logits_processors: list[Callable] | None = None
    truncate_prompt_tokens: int | None = None
    use_beam_search: bool = False  # the seed docs' API: best_of beams, the n best returned
    length_penalty: float = 1.0
    early_stopping: bool = False
    # token-id sequences of bad_words, filled from the tokenizer when the request is made
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    # a constraint on the output (structured outputs); guided_decoding is vLLM's older name of the same field
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: GuidedDecodingParams | None = None
    extra_args: dict | None = None  # for engine-wide logits processor classes (LLM(logits_processors=)); never read
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # what LLMEngine.step / AsyncLLMEngine stream

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            _check(isinstance(self.stop, (list, tuple)), "stop", self.stop, "a str or a list of str")
            self.stop = list(self.stop)
        ids = self.stop_token_ids
        _check(ids is None or isinstance(ids, (list, tuple)), "stop_token_ids", ids, "a list of token ids")
        self.stop_token_ids = list(ids or [])
        self._validate()
        self._validate_structured()
        self._validate_output_kind()

    def _validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n", self.n, "an integer >= 1")
        if self.best_of is not None:
            ok = isinstance(self.best_of, int) and self.best_of >= self.n
            _check(ok, "best_of", self.best_of, f"None or an integer >= n={self.n}")
        t = self.temperature
        _check(isinstance(t, (int, float)) and math.isfinite(t) and t >= 0, "temperature", t, "a finite number >= 0")
        p = self.top_p
        _check(isinstance(p, (int, float)) and 0.0 < p <= 1.0, "top_p", p, "(0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k", self.top_k, "-1 (off), 0 (off) or >= 1")
        m = self.min_p
        _check(isinstance(m, (int, float)) and 0.0 <= m <= 1.0, "min_p", m, "[0, 1]")
        if self.seed is not None:
            ok = isinstance(self.seed, int) and -(2**63) <= self.seed < 2**64
            _check(ok, "seed", self.seed, "None or an integer in [-2**63, 2**64)")
        if self.max_tokens is not None:
            _check(
                isinstance(self.max_tokens, int) and self.max_tokens >= 1,
                "max_tokens",
                self.max_tokens,
                "an integer >= 1",
            )
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", self.min_tokens, ">= 0")
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens, f"<= max_tokens={self.max_tokens}"
            )
        for s in self.stop:
            _check(isinstance(s, str) and s != "", "stop", s, "non-empty strings")
        for tid in self.stop_token_ids:
            _check(isinstance(tid, int) and tid >= 0, "stop_token_ids", tid, "non-negative token ids")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(isinstance(v, (int, float)) and -2.0 <= v <= 2.0, name, v, "[-2, 2]")
        r = self.repetition_penalty
        _check(isinstance(r, (int, float)) and math.isfinite(r) and r > 0, "repetition_penalty", r, "> 0 and finite")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            ok = v is None or (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_LOGPROBS)
            _check(ok, name, v, f"None or an integer in [0, {MAX_LOGPROBS}]")
        self._validate_token_maps()
        if self.use_beam_search:
            _check((self.best_of or self.n) > 1, "best_of", self.best_of, "> 1 with use_beam_search (the beam width)")
            _check(self.temperature < _SAMPLING_EPS, "temperature", self.temperature, "0 with use_beam_search")
            lp = self.length_penalty
            _check(isinstance(lp, (int, float)) and math.isfinite(lp), "length_penalty", lp, "a finite number")
        t = self.truncate_prompt_tokens
        ok = t is None or (isinstance(t, int) and not isinstance(t, bool) and (t >= 1 or t == -1))
        _check(ok, "truncate_prompt_tokens", t, "None, -1 (max_model_len) or an integer >= 1")
        if self.bad_words is not None:
            ok = isinstance(self.bad_words, (list, tuple)) and all(isinstance(w, str) and w for w in self.bad_words)
            _check(ok, "bad_words", self.bad_words, "a list of non-empty strings")
        if self.logits_processors is not None:
            ok = isinstance(self.logits_processors, (list, tuple)) and all(callable(f) for f in self.logits_processors)
            _check(ok, "logits_processors", self.logits_processors, "a list of callables")
        _check(self.extra_args is None or isinstance(self.extra_args, dict), "extra_args", self.extra_args, "a dict")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (the text is what they are matched against)")

    def _validate_structured(self) -> None:
        """structured_outputs and guided_decoding are one field under two names: a dict becomes the params class;
        either sets both."""
        for name, cls in (("structured_outputs", StructuredOutputsParams), ("guided_decoding", GuidedDecodingParams)):
            v = getattr(self, name)
            if isinstance(v, dict):
                try:
                    setattr(self, name, cls(**v))
                except TypeError as e:
                    raise ValueError(f"{name}: {e}") from None
            else:
                _check(v is None or isinstance(v, GuidedDecodingParams), name, v, f"None or a {cls.__name__}")
        so, gd = self.structured_outputs, self.guided_decoding
        if so is not None and gd is not None and so is not gd:
            raise ValueError("structured_outputs and guided_decoding are the same field: set only one of them")
        self.structured_outputs = self.guided_decoding = so or gd
        if self.structured_outputs is not None and self.use_beam_search:
            raise ValueError("structured_outputs cannot be combined with use_beam_search")

    def _validate_output_kind(self) -> None:
        kind = self.output_kind
        allowed = ", ".join(f"RequestOutputKind.{k.name} ({k.value})" for k in RequestOutputKind)
        ok = isinstance(kind, int) and not isinstance(kind, bool) and kind in set(RequestOutputKind)
        _check(ok, "output_kind", kind, allowed)
        self.output_kind = RequestOutputKind(kind)
        if self.output_kind == RequestOutputKind.DELTA and self.best_of not in (None, self.n):
            raise ValueError(
                f"output_kind=RequestOutputKind.DELTA needs best_of=None or best_of=n={self.n}, not "
                f"best_of={self.best_of}: the n best sequences are known only at the end"
            )

    def _validate_token_maps(self) -> None:
        if self.logit_bias is not None:
            _check(isinstance(self.logit_bias, dict), "logit_bias", self.logit_bias, "a dict of token id -> bias")
            for tid, bias in self.logit_bias.items():
                _check(isinstance(tid, int) and tid >= 0, "logit_bias", tid, "keys that are token ids (ints >= 0)")
                ok = isinstance(bias, (int, float)) and -100.0 <= bias <= 100.0
                _check(ok, "logit_bias", bias, "values in [-100, 100]")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            _check(isinstance(ids, (list, tuple)) and len(ids) > 0, "allowed_token_ids", ids, "a non-empty list")
            for tid in ids:
                _check(isinstance(tid, int) and tid >= 0, "allowed_token_ids", tid, "token ids (ints >= 0)")

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def top_k_enabled(self) -> int:
        """top_k as an integer where 0 means off."""
        return max(self.top_k, 0)

    def check_vocab(self, vocab_size: int) -> None:
        """Checks the token ids named in the params against the model's vocabulary (at submission). stop_token_ids
        may lie outside it (as vLLM): such an id never matches."""
        for name, ids in (
            ("logit_bias", list(self.logit_bias or {})),
            ("allowed_token_ids", self.allowed_token_ids or []),
        ):
            for tid in ids:
                _check(tid < vocab_size, name, tid, f"token ids in [0, {vocab_size})")

    def clone(self) -> SamplingParams:
        """A deep copy; logits processors are shared, not copied (they may hold state or resources)."""
        memo = {id(f): f for f in self.logits_processors or []}
        return copy.deepcopy(self, memo)

    def without_callables(self) -> SamplingParams:
        """A shallow copy without logits processors: plain data, for the step message (the callables stay where the
        engine runs)."""
        if not self.logits_processors:
            return self
        params = copy.copy(self)
        params.logits_processors = None
        return params


def __getattr__(name: str):
    """`from pagedllm.sampling_params import BeamSearchParams`, where vLLM's documents import it from (lazily:
    beam_search imports this module)."""
    if name == "BeamSearchParams":
        from pagedllm.beam_search import BeamSearchParams

        return BeamSearchParams
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
