"""What `LLM.generate` returns, with vLLM's class and field names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# the pooling outputs, importable from here as from vllm.outputs
from pagedllm.pooling.outputs import (  # noqa: F401
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)


@dataclass
class Logprob:
    """One token's log probability, its rank among all tokens (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it; None for EOS / length
    lora_request: Any = field(default=None, compare=False)  # the LoRARequest that served it (None: the base model)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """vLLM's RequestOutput.metrics: wall-clock times (time.time(), seconds) of a request's milestones, None until
    reached; time_in_queue is first_scheduled_time - arrival_time."""

    arrival_time: float
    last_token_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    time_in_queue: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None  # None: a prompt of embeddings (EmbedsPrompt), as vLLM's
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = field(default=None, compare=False)  # timings differ between equal outputs
    lora_request: Any = field(default=None, compare=False)  # the LoRARequest that served it (None: the base model)
