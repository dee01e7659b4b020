"""LLMEngine: validates and admits requests, steps the core, and turns its tokens into RequestOutputs."""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from collections.abc import Iterable
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.core import EngineCore
from pagedllm.engine.output_processor import OutputProcessor, RequestState, SequenceState
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.metrics import PREFIX, Gauge, Metric, engine_metrics
from pagedllm.outputs import RequestOutput
from pagedllm.prompt_embeds import PLACEHOLDER_ID, check_embeds, check_engine, embeds_of
from pagedllm.sampling_params import SamplingParams

_MM_KEYS = ("multi_modal_data", "multi_modal_uuids", "mm_processor_kwargs")
_PROMPT_KEYS = {"prompt", "prompt_token_ids", "prompt_embeds", "cache_salt", *_MM_KEYS}


def check_request_keywords(priority: int = 0, trace_headers: Any = None) -> None:
    """vLLM's request keywords that pagedllm supports at their defaults only."""
    if priority:
        raise ValueError(f"priority={priority!r}: only first-come-first-served order is supported (priority 0)")
    if trace_headers:
        raise ValueError("trace_headers: pagedllm has no OpenTelemetry tracing")


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer) -> None:
        check_engine(config)  # enable_prompt_embeds on a model that cannot take them: refused before loading
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
        generation = {**generation, **_checked_override(config.model.override_generation_config)}
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
        self._mm_processor = None  # MultiModalProcessor, made with the first multimodal prompt
        self._mm_lock = threading.Lock()

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

    def takes_multimodal(self) -> bool:
        from pagedllm.multimodal.config import MULTIMODAL_ARCHITECTURES

        return self.config.model.architecture in MULTIMODAL_ARCHITECTURES

    def process_multimodal(
        self, prompt, mm_data, mm_processor_kwargs=None, add_special_tokens: bool = True, where: str = "prompt"
    ) -> tuple[list[int], list]:
        """A prompt with multi_modal_data -> (prompt token ids with placeholders expanded, MultiModalFeatures).
        ValueError for a text-only model, a modality it does not take, too many items or a bad item."""
        model = self.config.model
        if not self.takes_multimodal():
            raise ValueError(f"{where}.multi_modal_data: {model.architecture} is a text-only model; it takes no images")
        return self.multimodal_processor().process(prompt, mm_data, mm_processor_kwargs, add_special_tokens, where)

    def multimodal_processor(self):
        """The model's multimodal processor (multimodal.processor.make_processor), made once."""
        from pagedllm.multimodal.config import MultiModalConfig
        from pagedllm.multimodal.processor import make_processor

        model = self.config.model
        with self._mm_lock:
            if self._mm_processor is None:
                self._mm_processor = make_processor(
                    model.architecture,
                    model.model_path,
                    model.hf_config.vision_language_config,
                    self.config.multimodal or MultiModalConfig(),
                    model.trust_remote_code,
                )
        return self._mm_processor

    def chat_media(self):
        """A ChatMedia to collect a conversation's images, for a model that takes them (None: a text-only model)."""
        from pagedllm.multimodal.config import MULTIMODAL_ARCHITECTURES, MultiModalConfig
        from pagedllm.multimodal.media import ChatMedia

        if "image" not in MULTIMODAL_ARCHITECTURES.get(self.config.model.architecture, ()):
            return None
        mm_config = self.config.multimodal or MultiModalConfig()
        processor = self.multimodal_processor()
        video = getattr(processor, "video_placeholder", "")  # "": the model takes no videos
        return ChatMedia(processor.image_placeholder, mm_config.allowed_local_media_path, video, mm_config.background)

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
        mm_features: list | None = None,
        prompt_embeds=None,
    ) -> tuple[list[Request], RequestState]:
        """Checks a request against the model and the cache without admitting it (raises ValueError).

        cache_salt (any non-empty str) enters the hash of the first prompt block: only requests with the same salt
        share cached prefixes, so tenants cannot probe each other's prompts through timing.

        lora_request: a LoRARequest (read and checked here the first time its id is seen), None: the base model.

        prompt_embeds: a tensor [seq_len, hidden] given instead of prompt_token_ids (pagedllm/prompt_embeds.py).

        Returns the core requests (one per sequence: n, or best_of) and the state that gathers their output."""
        model = self.config.model
        for cls in self.config.logits_processors:  # engine-wide logits processor classes check extra_args
            cls.validate_params(params)
        if prompt_embeds is not None:  # checked and truncated; placeholder ids stand for its positions
            hidden = model.hf_config.hidden_size
            prompt_embeds = check_embeds(prompt_embeds, hidden, params.truncate_prompt_tokens, model.max_model_len)
            prompt_token_ids = [PLACEHOLDER_ID] * len(prompt_embeds)
        if mm_features and params.truncate_prompt_tokens is not None:
            raise ValueError("truncate_prompt_tokens: a prompt with images cannot be truncated (it would cut them)")
        if params.truncate_prompt_tokens is not None:
            keep = model.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            prompt_token_ids = prompt_token_ids[-keep:]
        if not prompt_token_ids:
            raise ValueError("prompt is empty: a prompt needs at least one token")
        vl_config = getattr(model.hf_config, "vision_language_config", None)
        if vl_config is not None:
            from pagedllm.multimodal.processor import check_placeholders

            check_placeholders(prompt_token_ids, mm_features or [], vl_config)
            budget = self.core.scheduler.max_num_batched_tokens
            long = next((f for f in mm_features or [] if f.bidirectional and f.length > budget), None)
            if long is not None:
                raise ValueError(
                    f"max_num_batched_tokens={budget} is less than an image's {long.length} tokens, which "
                    "one prefill chunk must hold; allowed: max_num_batched_tokens >= the tokens of one image"
                )
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
        requests, state = self._sequences(request_id, prompt, prompt_token_ids, params, max_tokens, cache_salt,
                                          prompt_embeds)  # fmt: skip
        state.lora_request = lora_request
        for req in requests:
            req.lora_request = lora_request
            req.mm_features = list(mm_features or [])
            req.prompt_embeds = prompt_embeds
        for req in requests if compiled is not None else []:
            manager = self.structured_output_manager()
            req.grammar = manager.request_grammar(compiled, prompt_token_ids, self.reasoning_markers)  # a matcher each
        return requests, state

    def _sequences(self, request_id, prompt, prompt_token_ids, params, max_tokens, cache_salt, embeds=None):
        """n (or best_of) sequences of one request; with a seed, sequence i draws from seed + i. A prompt of
        embeddings (embeds): its text starts with no prompt context, and its output has no prompt ids (as vLLM's)."""
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
            seqs[seq_id] = SequenceState(i, prompt_token_ids if embeds is None else [], seq_params, tokenizer, report)
        state = RequestState(request_id, prompt, prompt_token_ids, params.n, seqs, requests)
        state.from_embeds = embeds is not None
        return requests, state

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
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        lora_request: Any = None,
        tokenization_kwargs: dict | None = None,
        trace_headers: Any = None,
        priority: int = 0,
        prompt_text: str | None = None,
    ) -> None:
        """vLLM's add_request: `prompt` is a text, a prompt dict ({"prompt": text} or {"prompt_token_ids": [...]},
        with "cache_salt" and, for a multimodal model, "multi_modal_data") or a token-id list (then `prompt_text`,
        if given, is its text). arrival_time is on the wall clock (time.time()); tokenization_kwargs go to the
        tokenizer's encode of a text prompt."""
        check_request_keywords(priority, trace_headers)
        text, token_ids, features, salt, embeds = self.prompt_parts(prompt, prompt_text, tokenization_kwargs)
        params = params if params is not None else SamplingParams()
        requests, state = self.make_request(text, token_ids, params, request_id, salt, lora_request, features, embeds)
        if arrival_time is not None:
            state.arrival_time = arrival_time - (time.time() - time.monotonic())  # kept on the monotonic clock
        self.add(requests, state)

    def prompt_parts(
        self, prompt: Any, prompt_text: str | None = None, tokenization_kwargs: dict | None = None
    ) -> tuple[str | None, list[int], list, str | None, Any]:
        """(text, token ids, MultiModalFeatures, cache_salt, prompt embeddings) of a prompt as vLLM's engines take
        it: a text, a token-id list, or a prompt dict (an unknown key, or a multimodal key for a text-only model, is
        a ValueError)."""
        features, salt, embeds = [], None, None
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - _PROMPT_KEYS)
            if unknown:
                raise ValueError(f"prompt.{unknown[0]}: not supported; a prompt dict takes {sorted(_PROMPT_KEYS)}")
            salt = prompt.get("cache_salt")
            embeds = embeds_of(prompt, self.config.model.enable_prompt_embeds)
            if salt is not None and (not isinstance(salt, str) or not salt):
                raise ValueError(f"prompt.cache_salt={salt!r}: must be a non-empty string")
            data = prompt.get("multi_modal_data")
            given = [k for k in _MM_KEYS if prompt.get(k) is not None]
            if given and not self.takes_multimodal():
                arch = self.config.model.architecture
                raise ValueError(f"prompt.{given[0]}: {arch} is a text-only model; multimodal inputs are not supported")
            if data is not None:
                from pagedllm.multimodal.hashing import apply_uuids

                ids, features = self.process_multimodal(prompt.get("prompt"), data, prompt.get("mm_processor_kwargs"))
                apply_uuids(features, data, prompt.get("multi_modal_uuids"), "prompt")
                prompt = {"prompt": prompt.get("prompt"), "prompt_token_ids": ids}
        text, token_ids = self.parse_prompt(prompt, prompt_text, tokenization_kwargs) if embeds is None else (None, [])
        return text, token_ids, features, salt, embeds

    def parse_prompt(
        self, prompt: Any, prompt_text: str | None = None, tokenization_kwargs: dict | None = None
    ) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            if self.tokenizer is None or self.config.model.skip_tokenizer_init:
                raise ValueError("a text prompt needs a tokenizer (skip_tokenizer_init=True gives none)")
            return prompt, self.tokenizer.encode(prompt, **(tokenization_kwargs or {}))
        if isinstance(prompt, (list, tuple)):
            return prompt_text, list(prompt)
        raise TypeError(f"prompt has type {type(prompt).__name__}; expected str, a prompt dict or list[int]")

    @classmethod
    def from_engine_args(cls, engine_args) -> LLMEngine:
        """vLLM's LLMEngine.from_engine_args(EngineArgs(model=...)) for a generative model."""
        from pagedllm.tokenizer import get_tokenizer

        config = engine_args.create_engine_config()
        if config.model.runner == "pooling":
            raise ValueError(f"{config.model.architecture} is a pooling model: use LLM(...).embed/classify/score")
        tokenizer = None
        if not engine_args.skip_tokenizer_init:
            model = config.model
            revision = engine_args.tokenizer_revision or engine_args.revision
            tokenizer = get_tokenizer(model.model_path, engine_args.tokenizer, model.trust_remote_code, revision,
                                      engine_args.download_dir)  # fmt: skip
        return cls(config, tokenizer)

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.states)

    @property
    def vllm_config(self):
        """vLLM's name of the engine's config (EngineConfig: `.model_config.hf_config`, `.scheduler_config`, ..., as
        vLLM's examples read it; `engine_config` is its older name)."""
        return self.config

    engine_config = vllm_config

    @property
    def model_config(self):
        """vLLM's LLMEngine.model_config."""
        return self.config.model

    def get_model_config(self):
        return self.config.model

    def get_tokenizer(self):
        return self.tokenizer

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Aborts one request (its id) or several (an iterable of ids); unknown ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.core.abort_requests(self.output_processor.sequence_ids(ids))
        self.output_processor.abort(ids)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """vLLM's step(): runs one engine step; returns the requests that finished in it and, with finished=False,
        the running requests that got tokens in it, each as its output_kind asks: its output so far (CUMULATIVE),
        what is new since its last output (DELTA), or nothing until it finishes (FINAL_ONLY). A stop string is never
        shown in part."""
        finished = self.step_finished()
        return finished + self.output_processor.unfinished_outputs()

    def step_finished(self) -> list[RequestOutput]:
        """Runs one engine step; returns only the requests that finished in it (what an offline batch waits for)."""
        finished, stop_ids = self.output_processor.process(self.core.step())
        if stop_ids:
            self.core.abort_requests(stop_ids, RequestStatus.FINISHED_STOPPED)
        return finished

    def shutdown(self) -> None:
        self.core.shutdown()

    def reset_prefix_cache(self) -> bool:
        return self.core.scheduler.kv.reset_prefix_cache()

    def get_metrics(self) -> list[Metric]:
        """The engine's counters, gauges and histograms now, under vLLM's names (`vllm:` prefix)."""
        labels = {"model_name": self.config.model.model}
        metrics = engine_metrics(self.core.scheduler, self.output_processor.stats, labels,
                                 self.config.speculative_config is not None)  # fmt: skip
        if self.config.lora is not None:
            metrics.append(_lora_info(self.core.scheduler, self.config.lora.max_loras))
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
    return Gauge(f"{PREFIX}lora_requests_info", labels, time.time())


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


def _checked_override(override: dict | None) -> dict:
    """override_generation_config: generation_config.json keys that replace the model's sampling defaults."""
    if override is None:
        return {}
    if not isinstance(override, dict) or set(override) - set(_SAMPLING_DEFAULTS):
        raise ValueError(
            f"override_generation_config={override!r} must be a dict of the keys {sorted(_SAMPLING_DEFAULTS)}"
        )
    return override


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
