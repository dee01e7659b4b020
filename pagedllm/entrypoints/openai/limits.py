"""Caps on one request to the server (HTTP 400 beyond them), with their documented defaults. No server imports
here, so the CLI can show them without the `serve` extra."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.sampling_params import MAX_LOGPROBS

DEFAULT_MAX_N = 16  # n and best_of
DEFAULT_MAX_PROMPTS = 256  # prompts in one completions call, inputs in one embeddings call
DEFAULT_MAX_LOGPROBS = MAX_LOGPROBS  # logprobs, top_logprobs, prompt_logprobs (20)
DEFAULT_MAX_BODY_BYTES = 16 << 20  # 16 MiB


@dataclass
class ServerLimits:
    max_n: int = DEFAULT_MAX_N
    max_prompts: int = DEFAULT_MAX_PROMPTS
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
