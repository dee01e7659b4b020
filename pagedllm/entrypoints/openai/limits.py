"""Caps on one request to the server (HTTP 400 beyond them), with their documented defaults. No server imports
here, so the CLI can show them without the `serve` extra."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.sampling_params import MAX_LOGPROBS

DEFAULT_MAX_N = 16  # n and best_of
DEFAULT_MAX_PROMPTS = 256  # prompts in one completions call, inputs in one embeddings call
DEFAULT_MAX_LOGPROBS = MAX_LOGPROBS  # logprobs, top_logprobs, prompt_logprobs (20)
DEFAULT_MAX_BODY_BYTES = 16 << 20  # 16 MiB
DEFAULT_MAX_STOP = 64  # stop strings in one request
DEFAULT_MAX_BAD_WORDS = 1024  # bad_words in one request
DEFAULT_MAX_WORD_CHARS = 1024  # characters in one stop string or bad word
MAX_JSON_DEPTH = 64  # nesting of a request body (and of tool-call arguments): deeper is refused, never recursed into


@dataclass
class ServerLimits:
    max_n: int = DEFAULT_MAX_N
    max_prompts: int = DEFAULT_MAX_PROMPTS
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_stop: int = DEFAULT_MAX_STOP
    max_bad_words: int = DEFAULT_MAX_BAD_WORDS
    max_word_chars: int = DEFAULT_MAX_WORD_CHARS
