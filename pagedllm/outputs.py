"""What `LLM.generate` returns, with vLLM's class and field names."""

from __future__ import annotations

import dataclasses
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

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Merges a later output of the same request into this one (vLLM's RequestOutput.add), for a reader slower
        than the engine. aggregate=True (DELTA outputs): each sequence's text, token ids and logprobs are appended
        to; False (cumulative outputs): each sequence is replaced by its newer output."""
        self.finished = self.finished or next_output.finished
        self.num_cached_tokens = next_output.num_cached_tokens
        self.metrics = next_output.metrics
        if next_output.prompt_logprobs is not None or not aggregate:
            self.prompt_logprobs = next_output.prompt_logprobs
        by_index = {c.index: i for i, c in enumerate(self.outputs)}
        for new in next_output.outputs:
            i = by_index.get(new.index)
            if i is None:
                by_index[new.index] = len(self.outputs)
                self.outputs.append(new)
            elif not aggregate:
                self.outputs[i] = new
            else:
                old = self.outputs[i]
                logprobs = old.logprobs if new.logprobs is None else [*(old.logprobs or []), *new.logprobs]
                self.outputs[i] = dataclasses.replace(
                    new, text=old.text + new.text, token_ids=[*old.token_ids, *new.token_ids], logprobs=logprobs
                )
        self.outputs.sort(key=lambda c: c.index)
