"""LLMEngine: validates and admits requests, steps the core, and turns its tokens into RequestOutputs."""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from collections.abc import Iterable

from pagedllm.config import EngineConfig
from pagedllm.engine.core import EngineCore
from pagedllm.engine.output_processor import OutputProcessor, RequestState, SequenceState
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.metrics import Counter, Gauge, Metric
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.core = EngineCore(config)
        self.output_processor = OutputProcessor(tokenizer)
        self.eos_token_id = _eos_token_id(tokenizer, config.model.hf_config)
        # generation_config.json may list more end-of-sequence ids (e.g. Llama 3's <|eot_id|>): they stop too
        model_generation = read_generation_config(config.model.model_path)
        self.extra_eos_ids = [t for t in _eos_list(model_generation) if t != self.eos_token_id]
        source = config.model.generation_config
        generation = (
            model_generation if source == "auto" else {} if source == "vllm" else read_generation_config(source)
        )
        # the sampling defaults the model's authors chose, used when a caller gives no SamplingParams (as vLLM)
        self.default_sampling_fields = {
            ours: generation[theirs]
            for theirs, ours in _SAMPLING_DEFAULTS.items()
            if generation.get(theirs) is not None
        }
        self._ids = itertools.count()
        self._structured = None  # StructuredOutputManager, made with the first constrained request
        self._structured_lock = threading.Lock()  # the server prepares requests on several threads
        # (start token ids, end token ids) of a reasoning section (set from a reasoning parser): a constrained
        # output's grammar then applies only after the end marker
        self.reasoning_markers: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self._removed_loras: set[int] = set()  # LoRA adapter ids removed (remove_lora) and not added again

    def structured_output_manager(self):
        """The grammar compilers and cache (xgrammar, llguidance), built once from the tokenizer, padded to the
        model's vocab."""
        with self._structured_lock:
            return self._structured or self._make_structured_output_manager()

    def _make_structured_output_manager(self):
        if self._structured is None:
            if self.tokenizer is None or self.config.model.skip_tokenizer_init:
                raise ValueError("structured_outputs need a tokenizer (skip_tokenizer_init=True gives none)")
            from pagedllm.structured_output import StructuredOutputManager

            stop_ids = [t for t in [self.eos_token_id, *self.extra_eos_ids] if t is not None]
            self._structured = StructuredOutputManager(
                self.tokenizer, self.config.model.vocab_size, stop_ids, self.config.guided_decoding_backend
            )
        return self._structured

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def make_request(
        self,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        lora_request=None,
    ) -> tuple[list[Request], RequestState]:
        """Checks a request against the model and the cache without admitting it (raises ValueError).

        cache_salt (any non-empty str) enters the hash of the first prompt block: only requests with the same salt
        share cached prefixes, so tenants cannot probe each other's prompts through timing.

        lora_request: a LoRARequest (read and checked here the first time its id is seen), None: the base model.

        Returns the core requests (one per sequence: n, or best_of) and the state that gathers their output."""
        model = self.config.model
        if params.truncate_prompt_tokens is not None:
            keep = model.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            prompt_token_ids = prompt_token_ids[-keep:]
        if not prompt_token_ids:
            raise ValueError("prompt is empty: a prompt needs at least one token")
        vocab = model.vocab_size
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids contains {bad!r}: token ids must be integers in [0, {vocab})")
        n = len(prompt_token_ids)
        if n > model.max_model_len:
            raise ValueError(
                f"prompt length {n} is longer than max_model_len={model.max_model_len}: allowed range [1, "
                f"{model.max_model_len}] tokens"
            )
        params.check_vocab(vocab)
        if lora_request is not None:
            self.add_lora(lora_request)
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt={cache_salt!r}: must be a non-empty string")
        if params.stop and (self.tokenizer is None or model.skip_tokenizer_init):
            raise ValueError("stop strings need a tokenizer (skip_tokenizer_init=True gives none)")
        params = params.clone()  # later changes to the caller's object must not reach a running request
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words need a tokenizer (skip_tokenizer_init=True gives none)")
            params.bad_words_token_ids = _bad_words_token_ids(self.tokenizer, params.bad_words)
        if self.extra_eos_ids and not params.ignore_eos:
            params.stop_token_ids += [t for t in self.extra_eos_ids if t not in params.stop_token_ids]
        limit = model.max_model_len - n
        max_tokens = max(1, limit if params.max_tokens is None else min(params.max_tokens, limit))
        self.core.scheduler.check_fits(n, max_tokens)
        request_id = request_id if request_id is not None else self.next_request_id()
        if request_id in self.core.scheduler.requests or request_id in self.output_processor.states:
            raise ValueError(f"request_id={request_id!r} is already in use")
        compiled = None  # the grammar's compilation (shared by the request's sequences), started now
        if params.structured_outputs is not None:
            compiled = self.structured_output_manager().grammar(params.structured_outputs)
        requests, state = self._sequences(request_id, prompt, prompt_token_ids, params, max_tokens, cache_salt)
        for req in requests:
            req.lora_request = lora_request
        for req in requests if compiled is not None else []:
            manager = self.structured_output_manager()
            req.grammar = manager.request_grammar(compiled, prompt_token_ids, self.reasoning_markers)  # a matcher each
        return requests, state

    def _sequences(self, request_id, prompt, prompt_token_ids, params, max_tokens, cache_salt):
        """n (or best_of) sequences of one request; with a seed, sequence i draws from seed + i."""
        count = params.best_of or params.n
        tokenizer = None if self.config.model.skip_tokenizer_init else self.tokenizer
        requests, seqs = [], {}
        for i in range(count):
            seq_id = request_id if count == 1 else f"{request_id}_{i}"
            seq_params = params.clone() if count > 1 else params
            if count > 1 and params.seed is not None:
                seq_params.seed = params.seed + i
            report = seq_params.logprobs is not None
            if count > params.n and seq_params.logprobs is None:
                seq_params.logprobs = 0  # best_of ranks sequences by cumulative logprob
            vocab = self.config.model.vocab_size
            requests.append(
                Request(seq_id, prompt_token_ids, seq_params, self.eos_token_id, max_tokens, cache_salt, vocab)
            )
            seqs[seq_id] = SequenceState(i, prompt_token_ids, seq_params, tokenizer, report)
        return requests, RequestState(request_id, prompt, prompt_token_ids, params.n, seqs)

    def add_lora(self, lora_request) -> bool:
        """Reads and checks a LoRA adapter (ValueError naming what is wrong) and keeps it ready; False if its id was
        known (with the same folder)."""
        if self.config.lora is None:
            raise ValueError("lora_request: LoRA is off; create the engine with enable_lora=True")
        added = self.core.executor.add_lora(lora_request)
        self._removed_loras.discard(lora_request.lora_int_id)
        return added

    def remove_lora(self, lora_id: int) -> bool:
        """New requests with the adapter are refused until it is added again; those in flight finish with it."""
        if self.config.lora is None or lora_id in self._removed_loras:
            return False
        if self.core.executor.runner.lora.remove(lora_id):
            self._removed_loras.add(lora_id)
            return True
        return False

    def list_loras(self) -> set[int]:
        if self.config.lora is None:
            return set()
        return set(self.core.executor.runner.lora.list_loras()) - self._removed_loras

    def add(self, requests: list[Request], state: RequestState) -> None:
        for req in requests:
            self.core.add_request(req)
        self.output_processor.add_request(state)

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None
    ) -> None:
        self.add(*self.make_request(prompt, prompt_token_ids, params, request_id))

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Aborts one request (its id) or several (an iterable of ids); unknown ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.core.abort_requests(self.output_processor.sequence_ids(ids))
        self.output_processor.abort(ids)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Runs one engine step; returns the requests that finished in it."""
        finished, stop_ids = self.output_processor.process(self.core.step())
        if stop_ids:
            self.core.abort_requests(stop_ids, RequestStatus.FINISHED_STOPPED)
        return finished

    def step_stream(self) -> list[RequestOutput]:
        """Runs one engine step; returns the requests that finished in it and, with finished=False, the output so
        far of the running requests that got tokens in it (for streaming: cumulative text, stop strings never shown
        in part)."""
        finished = self.step()
        return finished + self.output_processor.unfinished_outputs()

    def shutdown(self) -> None:
        self.core.shutdown()

    def reset_prefix_cache(self) -> bool:
        return self.core.scheduler.kv.reset_prefix_cache()

    def get_metrics(self) -> list[Metric]:
        """The engine's counters, gauges and latency histograms now (vLLM's names, `pagedllm:` prefix)."""
        sched = self.core.scheduler
        stats = self.output_processor.stats
        labels = {"model_name": self.config.model.model}
        metrics: list[Metric] = [
            Gauge("pagedllm:num_requests_running", labels, len(sched.running)),
            Gauge("pagedllm:num_requests_waiting", labels, len(sched.waiting)),
            Gauge("pagedllm:kv_cache_usage_perc", labels, sched.kv.pool.usage()),
            Counter("pagedllm:prefix_cache_queries_total", labels, sched.kv.num_queries),
            Counter("pagedllm:prefix_cache_hits_total", labels, sched.kv.num_hits),
            Counter("pagedllm:num_preemptions_total", labels, sched.num_preemptions),
            Counter("pagedllm:prompt_tokens_total", labels, stats.prompt_tokens),
            Counter("pagedllm:generation_tokens_total", labels, stats.generation_tokens),
        ]
        if self.config.speculative_config is not None:
            metrics += _spec_decode_metrics(sched, labels)
        if self.config.lora is not None:
            metrics.append(_lora_info(sched, self.config.lora.max_loras))
        for reason, count in stats.success_by_reason.items():
            metrics.append(Counter("pagedllm:request_success_total", {**labels, "finished_reason": reason}, count))
        metrics.append(stats.time_to_first_token.to_metric("pagedllm:time_to_first_token_seconds", labels))
        metrics.append(stats.inter_token_latency.to_metric("pagedllm:inter_token_latency_seconds", labels))
        metrics.append(stats.e2e_request_latency.to_metric("pagedllm:e2e_request_latency_seconds", labels))
        return metrics


def _spec_decode_metrics(sched, labels: dict[str, str]) -> list[Metric]:
    """vLLM's speculative-decoding counters: draft sequences, draft tokens, accepted tokens, and accepted tokens
    per position in the draft sequence (label `position`)."""
    metrics: list[Metric] = [
        Counter("pagedllm:spec_decode_num_drafts_total", labels, sched.num_drafts),
        Counter("pagedllm:spec_decode_num_draft_tokens_total", labels, sched.num_draft_tokens),
        Counter("pagedllm:spec_decode_num_accepted_tokens_total", labels, sched.num_accepted_tokens),
    ]
    for pos, count in enumerate(sched.num_accepted_per_pos):
        name = "pagedllm:spec_decode_num_accepted_tokens_per_pos_total"
        metrics.append(Counter(name, {**labels, "position": str(pos)}, count))
    return metrics


def _lora_info(sched, max_loras: int) -> Metric:
    """vLLM's lora_requests_info: the adapters of the running and the waiting requests (names, comma-separated) as
    labels; the value is the time it was read."""

    def names(requests) -> str:
        return ",".join(sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None}))

    labels = {
        "max_lora": str(max_loras),
        "running_lora_adapters": names(sched.running),
        "waiting_lora_adapters": names(sched.waiting),
    }
    return Gauge("pagedllm:lora_requests_info", labels, time.time())


def _bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word as token ids, alone and after a space (as it appears inside text), without special tokens, in
    order without repeats. One batch call to the tokenizer and a set for the repeats: linear in the number of words."""
    texts = [text for word in words for text in (word, " " + word.lstrip())]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    unique = dict.fromkeys(tuple(ids) for ids in encoded if ids)  # an ordered set
    return [list(ids) for ids in unique]


_SAMPLING_DEFAULTS = {  # generation_config.json key -> SamplingParams field
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def read_generation_config(path: str) -> dict:
    """A model directory's generation_config.json as a dict (empty when there is none, or for a .gguf file)."""
    file = path if path.endswith(".json") else os.path.join(path, "generation_config.json")
    if not os.path.isfile(file):
        return {}
    with open(file, encoding="utf-8") as f:
        return json.load(f)


def _eos_list(generation: dict) -> list[int]:
    eos = generation.get("eos_token_id")
    if eos is None:
        return []
    return [int(t) for t in (eos if isinstance(eos, list) else [eos])]


def _eos_token_id(tokenizer, hf_config) -> int | None:
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return eos
