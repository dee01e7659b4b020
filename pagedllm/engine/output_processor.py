"""OutputProcessor: turns the core's new tokens into RequestOutputs: text, stop strings, logprobs, finish reasons.

A user request with n > 1 (or best_of > n) runs as several sequences in the core; its RequestState gathers them
and reports once all are finished. Its outputs follow its SamplingParams.output_kind: cumulative, deltas since its
last output, or the final one only."""

from __future__ import annotations

import time

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.scheduler import EngineCoreOutput
from pagedllm.metrics import RequestStats
from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


def _logprob_dict(ids: list[int], lps: list[float], ranks: list[int], tokenizer) -> dict[int, Logprob]:
    """token id -> Logprob(logprob, rank, text), the first entry (the chosen token) winning duplicates."""
    position: dict[int, Logprob] = {}
    for tid, lp, rank in zip(ids, lps, ranks):
        if tid not in position:
            position[tid] = Logprob(lp, rank, tokenizer.decode([tid]) if tokenizer is not None else None)
    return position


def stop_prefix_length(text: str, stops: list[str]) -> int:
    """The length of the longest end of `text` that is the start of a stop string (a stop string may yet complete
    there): a stream holds those characters back, so it never shows part of a stop string."""
    longest = min(len(text), max((len(s) for s in stops), default=1) - 1)
    for size in range(longest, 0, -1):
        tail = text[-size:]
        if any(len(s) > size and s.startswith(tail) for s in stops):
            return size
    return 0


class SequenceState:
    """One generated sequence: its tokens, text, logprobs and why it ended."""

    def __init__(
        self, index: int, prompt_token_ids: list[int], params: SamplingParams, tokenizer, report_logprobs: bool
    ) -> None:
        self.index = index
        self.params = params
        self.tokenizer = tokenizer
        self.report_logprobs = report_logprobs
        self.token_ids: list[int] = []
        self.detok = None
        if tokenizer is not None and params.detokenize:
            self.detok = IncrementalDetokenizer(
                tokenizer, prompt_token_ids, params.skip_special_tokens, params.spaces_between_special_tokens
            )
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        # what earlier DELTA outputs carried: token ids, characters of text, logprob entries, the finish
        self.sent_tokens = self.sent_chars = self.sent_logprobs = 0
        self.sent_finish = False

    def add_logprobs(self, entries: list[tuple[list[int], list[float], list[int]]]) -> None:
        """One dict per new token: the sampled token and the top-k, token id -> Logprob(logprob, rank, text)."""
        for ids, lps, ranks in entries:
            self.logprobs.append(_logprob_dict(ids, lps, ranks, self.tokenizer))
            self.cumulative_logprob += lps[0]

    def add_tokens(self, token_ids: list[int], stopped_by_token: bool) -> bool:
        """Appends tokens and their text; True when a stop string ended the sequence (text cut at it).

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

    def visible_text(self) -> str:
        """The text so far; while the sequence runs, without an end that could be the start of a stop string."""
        if self.finish_reason is not None or not self.params.stop:
            return self.text
        return self.text[: len(self.text) - stop_prefix_length(self.text, self.params.stop)]

    def to_output(self, index: int) -> CompletionOutput:
        return CompletionOutput(
            index=index,
            text=self.visible_text(),
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob if self.report_logprobs else None,
            logprobs=self.logprobs if self.report_logprobs else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )

    def delta_output(self, index: int) -> CompletionOutput | None:
        """What is new since the last delta (None: nothing): the token ids, the text now visible (held-back text
        that may begin a stop string comes once it cannot), the logprob entries; cumulative_logprob stays a total."""
        text = self.visible_text()
        done = self.finish_reason is not None
        new_ids = self.token_ids[self.sent_tokens :]
        if not new_ids and len(text) <= self.sent_chars and (not done or self.sent_finish):
            return None
        new_text = text[self.sent_chars :]
        logprobs = None
        if self.report_logprobs and self.logprobs is not None:
            logprobs = self.logprobs[self.sent_logprobs :]
            self.sent_logprobs = len(self.logprobs)
        self.sent_tokens, self.sent_chars, self.sent_finish = len(self.token_ids), max(len(text), self.sent_chars), done
        return CompletionOutput(
            index=index,
            text=new_text,
            token_ids=new_ids,
            cumulative_logprob=self.cumulative_logprob if self.report_logprobs else None,
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


class RequestState:
    """A user request: its prompt and the sequences generated for it (n, or best_of to pick n from)."""

    def __init__(
        self,
        req_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        n: int,
        sequences: dict[str, SequenceState],
        core_requests: list | None = None,
    ) -> None:
        self.req_id = req_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.from_embeds = False  # a prompt of embeddings: placeholder ids here, None in its outputs (as vLLM's)
        self.n = n
        self.sequences = sequences  # core request id -> sequence
        self.num_cached_tokens = 0
        self.arrival_time = time.monotonic()
        self.lora_request = None  # the request's LoRARequest (None: the base model), shown on its outputs
        self.last_token_time: float | None = None  # None until the first token
        self.core_requests = core_requests or []  # the engine's Requests (first scheduled time, max_tokens)
        self.scheduled_time: float | None = None  # first admission of any of its sequences
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        first = next(iter(sequences.values()))
        self.tokenizer = first.tokenizer
        # LLM.generate sets FINAL_ONLY here (it returns whole outputs whatever the params ask)
        self.output_kind = RequestOutputKind(first.params.output_kind)
        self.sent_prompt_logprobs = False  # a DELTA output carried them (they come once)
        wants_prompt_logprobs = first.params.prompt_logprobs is not None
        self.prompt_logprobs: list | None = [None] * len(prompt_token_ids) if wants_prompt_logprobs else None

    def add_prompt_logprobs(self, first_position: int, entries: list) -> None:
        """Places each prompt token's logprobs at its position (a recomputed chunk writes the same places again)."""
        for offset, (ids, lps, ranks) in enumerate(entries):
            self.prompt_logprobs[first_position + offset] = _logprob_dict(ids, lps, ranks, self.tokenizer)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences.values())

    def chosen_sequences(self) -> list[SequenceState]:
        """The sequences an output shows, in order: all of them, or with best_of the n with the highest
        cumulative logprob."""
        seqs = sorted(self.sequences.values(), key=lambda s: s.index)
        if len(seqs) > self.n:
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: self.n]
        return seqs

    def make_output(self) -> RequestOutput | None:
        """The output its output_kind asks for now (None: none, as FINAL_ONLY before the end or a DELTA with
        nothing new). A DELTA output holds only the sequences with something new, each under its own index."""
        if self.output_kind == RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        if self.output_kind != RequestOutputKind.DELTA:
            return self.to_output()
        outputs = [c for s in self.chosen_sequences() if (c := s.delta_output(s.index)) is not None]
        if not outputs and not self.finished:
            return None
        prompt_logprobs = None if self.sent_prompt_logprobs else self.prompt_logprobs
        self.sent_prompt_logprobs = True
        return self._request_output(outputs, prompt_logprobs)

    def to_output(self) -> RequestOutput:
        """The cumulative output: everything generated so far."""
        outputs = [s.to_output(i) for i, s in enumerate(self.chosen_sequences())]
        return self._request_output(outputs, self.prompt_logprobs)

    def _request_output(self, outputs: list[CompletionOutput], prompt_logprobs: list | None) -> RequestOutput:
        for out in outputs if self.lora_request is not None else ():
            out.lora_request = self.lora_request
        return RequestOutput(
            request_id=self.req_id,
            prompt=self.prompt,
            prompt_token_ids=None if self.from_embeds else self.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self._metrics(),
            lora_request=self.lora_request,
        )

    def _metrics(self) -> RequestMetrics:
        """The milestones so far, on the wall clock (they are kept on the monotonic one)."""
        shift = time.time() - time.monotonic()
        scheduled = [r.first_scheduled_time for r in self.core_requests if r.first_scheduled_time is not None]
        first_scheduled = self.scheduled_time if self.scheduled_time is not None else min(scheduled, default=None)

        def wall(t: float | None) -> float | None:
            return None if t is None else t + shift

        return RequestMetrics(
            arrival_time=self.arrival_time + shift,
            last_token_time=wall(self.last_token_time),
            first_scheduled_time=wall(first_scheduled),
            first_token_time=wall(self.first_token_time),
            time_in_queue=None if first_scheduled is None else first_scheduled - self.arrival_time,
            finished_time=wall(self.finished_time),
        )


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}  # user request id -> state
        self.parent_of: dict[str, str] = {}  # core request id -> user request id
        self.updated: dict[str, None] = {}  # user request ids that got tokens in the last process(), in order
        self.stats = RequestStats()

    def add_request(self, state: RequestState) -> None:
        self.states[state.req_id] = state
        for seq_id in state.sequences:
            self.parent_of[seq_id] = state.req_id

    def sequence_ids(self, req_ids: list[str]) -> list[str]:
        """The core request ids behind user request ids (unknown ids pass through)."""
        return [s for r in req_ids for s in (self.states[r].sequences if r in self.states else [r])]

    def abort(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            state = self.states.pop(req_id, None)
            for seq_id in state.sequences if state else []:
                self.parent_of.pop(seq_id, None)

    def unfinished_outputs(self) -> list[RequestOutput]:
        """The output (finished=False) of each running request that got tokens in the last process(), for
        streaming, as its output_kind asks (none for FINAL_ONLY); text that could be the start of a stop string is
        held back."""
        outputs = (self.states[r].make_output() for r in self.updated if r in self.states)
        return [out for out in outputs if out is not None]

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """(finished request outputs, sequence ids the core must stop because a stop string matched)."""
        finished: list[RequestOutput] = []
        to_abort: list[str] = []
        self.updated = {}
        now = time.monotonic()
        for out in outputs:
            state = self.states.get(self.parent_of.get(out.req_id, ""))
            if state is None:
                continue
            seq = state.sequences[out.req_id]
            self.updated[state.req_id] = None
            state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
            if out.prompt_logprobs is not None and state.prompt_logprobs is not None:
                state.add_prompt_logprobs(*out.prompt_logprobs)
            by_token = out.finish_reason == "stop" and not isinstance(out.stop_reason, str)
            num_before = len(seq.token_ids)
            stopped = seq.add_tokens(out.new_token_ids, by_token)
            num_kept = len(seq.token_ids) - num_before  # a stop string drops the step's tokens after it
            self._record_timing(state, num_kept, now)
            if out.new_logprobs is not None and seq.logprobs is not None:
                seq.add_logprobs(out.new_logprobs[:num_kept])
            if stopped and out.finish_reason is None:
                to_abort.append(out.req_id)
            elif not stopped and out.finish_reason is not None:
                seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
            if state.finished:
                state.finished_time = now
                output = state.make_output()
                self._record_finish(state)
                finished.append(output)
                self.abort([state.req_id])
        return finished, to_abort

    def _record_timing(self, state: RequestState, num_new_tokens: int, now: float) -> None:
        if num_new_tokens == 0:
            return
        stats = self.stats
        stats.generation_tokens += num_new_tokens
        if state.last_token_time is None:
            stats.prompt_tokens += len(state.prompt_token_ids)
            stats.time_to_first_token.observe(now - state.arrival_time)
            times = [r.first_scheduled_time for r in state.core_requests if r.first_scheduled_time is not None]
            state.scheduled_time = min(times, default=state.arrival_time)
            state.first_token_time = now
            stats.request_queue_time.observe(state.scheduled_time - state.arrival_time)
            stats.request_prefill_time.observe(now - state.scheduled_time)
        elif now > state.last_token_time:  # sequences of one request share a step: one interval per step
            stats.inter_token_latency.observe(now - state.last_token_time)
        state.last_token_time = now

    def _record_finish(self, state: RequestState) -> None:
        chosen = state.chosen_sequences()
        reason = chosen[0].finish_reason if chosen else None
        stats, now = self.stats, time.monotonic()
        if reason in stats.success_by_reason:
            stats.success_by_reason[reason] += 1
        stats.e2e_request_latency.observe(now - state.arrival_time)
        first_token = state.first_token_time if state.first_token_time is not None else now
        stats.request_decode_time.observe(now - first_token)
        scheduled = state.scheduled_time if state.scheduled_time is not None else state.arrival_time
        stats.request_inference_time.observe(now - scheduled)
        lengths = [len(s.token_ids) for s in state.sequences.values()]
        stats.request_prompt_tokens.observe(len(state.prompt_token_ids))
        stats.request_generation_tokens.observe(sum(lengths))
        stats.request_max_num_generation_tokens.observe(max(lengths, default=0))
        stats.request_params_n.observe(state.n)
        if state.core_requests:
            stats.request_params_max_tokens.observe(state.core_requests[0].max_tokens)
