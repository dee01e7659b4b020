"""What the scheduler tells the model runner each step (a delta), and what the runner answers.

The step message is plain data (it pickles, and could cross a process): ids, counts, token and block ids, sampling
parameters without callables (a request's logits processors stay in the engine's process: the engine registers
them with the runner it holds, keyed by request id), and numpy arrays."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request entering the batch: new, or resumed after preemption (then all its tokens are listed again)."""

    req_id: str
    token_ids: list[int]  # prompt + tokens generated so far
    num_prompt_tokens: int
    sampling_params: SamplingParams  # without logits_processors (SamplingParams.without_callables)
    block_ids: list[int]
    num_computed_tokens: int
    min_tokens_stop_ids: list[int]  # EOS and stop token ids, masked while fewer than min_tokens are out
    lora_request: Any = None  # the request's LoRARequest (plain data: name, id, folder); None: the base model
    mm_features: list = field(default_factory=list)  # MultiModalFeature per item (tensors, hash, placeholder span)
    has_logits_processors: bool = False  # its params had logits processors (they stay in the engine's process)
    prompt_embeds: Any = None  # [num_prompt_tokens, hidden] CPU tensor of a prompt given as embeddings


@dataclass
class CachedRequestData:
    """A request already in the batch: the blocks it got this step and where its computation stands."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int

    def __reduce__(self):  # pickled as its constructor's arguments: a 256-row step's message 1.5-2x faster both ways
        return (CachedRequestData, (self.req_id, self.new_block_ids, self.num_computed_tokens))


@dataclass
class SchedulerOutput:
    new_reqs: list[NewRequestData]
    cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # in batch order
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)  # finished or aborted since the last step
    preempted_req_ids: set[str] = field(default_factory=set)  # preempted since the last step (they come back)
    step_id: int = 0  # the scheduler's count of its steps (its update finds the step's requests by it)
    # req_id -> the tokens the request may sample this step: packed int32 [ceil(vocab / 32)], bit j of word w allows
    # token 32 * w + j (as xgrammar and llguidance fill it); a request without one is unconstrained
    grammar_bitmask: dict[str, np.ndarray] = field(default_factory=dict)
    # draft tokens to verify, after the request's known tokens (they count in num_scheduled_tokens and get KV slots)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class ModelRunnerOutput:
    # only requests that reached the end of their known tokens: the accepted drafts, then one sampled token
    sampled_token_ids: dict[str, list[int]]
    # request -> per emitted token (token ids, logprobs, ranks): the emitted token first, then its top-k; only where
    # asked for
    logprobs: dict[str, list[tuple[list[int], list[float], list[int]]]] = field(default_factory=dict)
    # request -> (first prompt position, entries as above with the prompt token first) for prompt_logprobs
    prompt_logprobs: dict[str, tuple[int, list]] = field(default_factory=dict)
