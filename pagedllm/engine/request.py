"""A request's state inside the engine core: its tokens, how many are computed, and why it finished."""

from __future__ import annotations

import enum

from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = 4  # max_tokens or max_model_len
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        max_tokens: int,
        cache_salt: str | None = None,
        vocab_size: int | None = None,
        lora_request=None,
        mm_features: list | None = None,
    ) -> None:
        self.request_id = request_id
        self.vocab_size = vocab_size  # stop ids at or above it never come: min_tokens need not ban them
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.max_tokens = max_tokens  # already capped by max_model_len - prompt length
        self.cache_salt = cache_salt
        self.lora_request = lora_request  # its LoRARequest; None: the base model
        self.mm_features = mm_features or []  # MultiModalFeature per item, in prompt order (placeholder spans)
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # tokens scheduled to be sampled whose values have not come back from the device yet (async scheduling)
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 until then
        self.first_scheduled_time: float | None = None  # time.monotonic() at first admission (metrics)
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []  # hashes of the full blocks of all_token_ids, filled by the KV manager
        self.spec_token_ids: list[int] = []  # draft tokens proposed for its next step (speculative decoding)
        self.grammar = None  # its RequestGrammar (structured outputs), set by the engine; None: unconstrained
        # [num_prompt_tokens, hidden] CPU tensor of a prompt given as embeddings (its prompt ids are placeholders)
        self.prompt_embeds = None

    @property
    def needs_prompt_logprobs(self) -> bool:
        return getattr(self.sampling_params, "prompt_logprobs", None) is not None

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def can_speculate(self) -> bool:
        """Whether drafts may be verified for it: bad words and logits processors read the request's output tokens
        on the host, without the drafts before each draft position (penalties count them: sample/adjust.py). A
        grammar may: its matcher is advanced over the drafts for one mask per position (structured_output/)."""
        params = self.sampling_params  # (a prompt of embeddings: no drafts, proposers read its placeholder ids)
        return not (params.bad_words_token_ids or params.logits_processors or self.prompt_embeds is not None)

    def min_tokens_stop_ids(self) -> list[int]:
        """The tokens that may not be sampled before min_tokens outputs: EOS (unless ignored) and stop ids."""
        params = self.sampling_params
        if params.min_tokens == 0:
            return []
        eos = [] if params.ignore_eos or self.eos_token_id is None else [self.eos_token_id]
        vocab = self.vocab_size
        return eos + [t for t in params.stop_token_ids if t != self.eos_token_id and (vocab is None or t < vocab)]

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def append_output_tokens(self, token_ids: list[int]) -> list[int]:
        """Appends the step's tokens up to the first that ends the request (EOS, a stop token or the length);
        returns those appended (the rest are dropped)."""
        for i, token_id in enumerate(token_ids):
            self.all_token_ids.append(token_id)
            if self.check_stop():
                return token_ids[: i + 1]
        return token_ids

    def check_stop(self) -> bool:
        """Marks the request finished after its newest token if EOS, a stop token or the length says so."""
        params = self.sampling_params
        last = self.all_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last == self.eos_token_id:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if self.num_output_tokens >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
