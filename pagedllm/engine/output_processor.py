"""OutputProcessor: turns the core's new tokens into RequestOutputs: text, stop strings, finish reasons."""

from __future__ import annotations

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.scheduler import EngineCoreOutput
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams


class RequestState:
    def __init__(
        self, req_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams, tokenizer
    ) -> None:
        self.req_id = req_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.token_ids: list[int] = []
        self.detok = None
        if tokenizer is not None and params.detokenize:
            self.detok = IncrementalDetokenizer(
                tokenizer, prompt_token_ids, params.skip_special_tokens, params.spaces_between_special_tokens
            )
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.tokenizer = tokenizer
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None

    def add_logprobs(self, entries: list[tuple[list[int], list[float], list[int]]]) -> None:
        """One dict per new token: the sampled token and the top-k, token id -> Logprob(logprob, rank, text)."""
        for ids, lps, ranks in entries:
            position = {}
            for tid, lp, rank in zip(ids, lps, ranks):
                if tid not in position:
                    text = self.tokenizer.decode([tid]) if self.tokenizer is not None else None
                    position[tid] = Logprob(lp, rank, text)
            self.logprobs.append(position)
            self.cumulative_logprob += lps[0]

    def add_tokens(self, token_ids: list[int], stopped_by_token: bool) -> bool:
        """Appends tokens and their text; True when a stop string ended the request (text cut at it).

        A final EOS or stop token (stopped_by_token) stays in token_ids but adds no text, as in vLLM, unless
        include_stop_str_in_output asks for it."""
        for i, token_id in enumerate(token_ids):
            self.token_ids.append(token_id)
            is_stop_token = stopped_by_token and i == len(token_ids) - 1
            if self.detok is None or (is_stop_token and not self.params.include_stop_str_in_output):
                continue
            delta = self.detok.add_token(token_id)
            self.text = self.detok.text
            if delta and self.params.stop and len(self.token_ids) >= self.params.min_tokens:
                if self._check_stop_strings(len(delta)):
                    return True
        return False

    def _check_stop_strings(self, new_chars: int) -> bool:
        for stop in self.params.stop:
            start = max(0, len(self.text) - new_chars - len(stop) + 1)
            idx = self.text.find(stop, start)
            if idx != -1:
                end = idx + len(stop) if self.params.include_stop_str_in_output else idx
                self.text = self.text[:end]
                self.finish_reason, self.stop_reason = "stop", stop
                return True
        return False

    def to_output(self) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=self.text,
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        return RequestOutput(
            request_id=self.req_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[completion],
            finished=self.finish_reason is not None,
            num_cached_tokens=self.num_cached_tokens,
        )


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, state: RequestState) -> None:
        self.states[state.req_id] = state

    def abort(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self.states.pop(req_id, None)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """(finished request outputs, ids the core must stop because a stop string matched)."""
        finished: list[RequestOutput] = []
        to_abort: list[str] = []
        for out in outputs:
            state = self.states.get(out.req_id)
            if state is None:
                continue
            state.num_cached_tokens = out.num_cached_tokens
            by_token = out.finish_reason == "stop" and not isinstance(out.stop_reason, str)
            if out.new_logprobs is not None and state.logprobs is not None:
                state.add_logprobs(out.new_logprobs)
            stopped = state.add_tokens(out.new_token_ids, by_token)
            if stopped and out.finish_reason is None:
                to_abort.append(out.req_id)
            elif not stopped and out.finish_reason is not None:
                state.finish_reason, state.stop_reason = out.finish_reason, out.stop_reason
            if state.finish_reason is not None:
                finished.append(state.to_output())
                del self.states[out.req_id]
        return finished, to_abort
