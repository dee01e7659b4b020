"""The offline API: `LLM(...)` and `LLM.generate(...)`, with vLLM's names and behaviour."""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from typing import Any

import torch

from pagedllm import envs
from pagedllm.beam_search import BeamSearchOutput, BeamSearchParams, run_beam_search, token_logprobs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.pooling_engine import PoolingEngine
from pagedllm.engine_args import EngineArgs
from pagedllm.entrypoints.pooling_api import PoolingAPI
from pagedllm.entrypoints.pooling_api import _as_list as _pooled_items
from pagedllm.lora.request import lora_list
from pagedllm.metrics import Metric
from pagedllm.multimodal.hashing import apply_uuids
from pagedllm.multimodal.inputs import ProcessedPrompt
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.prompt_embeds import check_engine, embeds_of
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.startup import StartupTimer, log_split, startup_split
from pagedllm.tokenizer import get_tokenizer
from pagedllm.utils.torch_utils import set_random_seed


class LLM(PoolingAPI):
    """An offline engine for one model. `LLM()` with no model runs the bundled SmolLM2-135M-Instruct,
    `LLM(task="embed")` the bundled all-MiniLM-L6-v2 (embed / score / encode come from PoolingAPI)."""

    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        revision: str | None = None,
        dtype: str | torch.dtype = "auto",
        seed: int | None = 0,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        block_size: int = 16,
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool = False,
        async_scheduling: bool | None = None,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        distributed_executor_backend: str | None = None,
        data_parallel_size: int = 1,
        trust_remote_code: bool = False,
        skip_tokenizer_init: bool = False,
        hf_overrides: Any = None,
        rope_scaling: dict | None = None,
        rope_theta: float | None = None,
        load_format: str = "auto",
        quantization: str | None = None,
        num_gpu_blocks_override: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        kv_cache_dtype: str = "auto",
        enable_prefix_caching: bool = True,
        compilation_config: Any = None,
        device: str | None = None,
        generation_config: str = "auto",
        attention_backend: str = "auto",
        task: str = "auto",
        runner: str = "auto",
        convert: str = "auto",
        pooler_config: Any = None,
        override_pooler_config: Any = None,
        model_impl: str = "auto",
        speculative_config: dict | None = None,
        speculative_model: str | None = None,
        num_speculative_tokens: int | None = None,
        ngram_prompt_lookup_max: int | None = None,
        ngram_prompt_lookup_min: int | None = None,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        lora_dtype: Any = "auto",
        fully_sharded_loras: bool = False,
        limit_mm_per_prompt: dict | None = None,
        mm_processor_kwargs: dict | None = None,
        allowed_local_media_path: str = "",
        guided_decoding_backend: str = "auto",
        **kwargs: Any,
    ) -> None:
        """Every EngineArgs field is a keyword (the ones not listed above through **kwargs, as vLLM's LLM)."""
        unknown = sorted(set(kwargs) - set(EngineArgs.names()))
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword arguments {unknown}")
        args = {k: v for k, v in locals().items() if k in EngineArgs.names()} | kwargs
        timer = StartupTimer()
        with timer.phase("config"):
            self.engine_args = EngineArgs(**args)
            config = self.engine_args.create_engine_config()
        from pagedllm.entrypoints.data_parallel import start_replicas  # here: it is also the replicas' __main__

        with timer.phase("engine"):
            self.data_parallel = start_replicas(self.engine_args, config)  # None: one replica
        tok = None
        if not skip_tokenizer_init:
            args = self.engine_args
            with timer.phase("tokenizer"):
                tok = get_tokenizer(config.model.model_path, tokenizer, trust_remote_code,
                                    args.tokenizer_revision or revision, args.download_dir)  # fmt: skip
        check_engine(config)  # enable_prompt_embeds where the model cannot take them (a pooling model, ...)
        engine_cls = PoolingEngine if config.model.runner == "pooling" else LLMEngine
        with timer.phase("engine"):
            if self.data_parallel is None:
                self.llm_engine = engine_cls(config, tok)
            else:
                self.llm_engine = self.data_parallel.build_local(lambda: engine_cls(config, tok))
        if seed is not None and envs.seeds_caller_generators():  # as vLLM's engine in the caller's process
            set_random_seed(seed)
        # seconds per start-up phase (pagedllm/startup.py), for benchmarks; logged in one line
        self.startup_seconds = startup_split(timer, self.llm_engine)
        log_split(self.startup_seconds)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json defaults (temperature, top_p, ...) applied."""
        self._require_generate("get_default_sampling_params")
        return SamplingParams(**self.llm_engine.default_sampling_fields)

    def beam_search(self, prompts: list, params: BeamSearchParams, lora_request: Any = None) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: the beam_width best sequences of each prompt (str, TextPrompt or TokensPrompt);
        lora_request: one LoRARequest for all prompts or one (or None) per prompt."""
        self._require_generate("beam_search")
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        parsed = [self._parse_prompt(p, i) for i, p in enumerate(_as_prompt_list(prompts))]
        if not parsed:
            raise ValueError("prompts is empty: give at least one prompt")
        return run_beam_search(
            self, [ids for _, ids in parsed], params, lora_requests=lora_list(lora_request, len(parsed))
        )

    def _beam_search_output(self, text: str | None, ids: list[int], params: SamplingParams, lora=None) -> RequestOutput:
        """SamplingParams(use_beam_search=True): best_of beams, the n best as completions."""
        if not params.use_beam_search:
            raise ValueError("use_beam_search: mix beam-search and sampling requests in separate generate calls")
        self.llm_engine.make_request(text, ids, params, lora_request=lora)  # the same checks as any request
        beam = BeamSearchParams(
            beam_width=params.best_of or params.n,
            max_tokens=params.max_tokens or 16,
            ignore_eos=params.ignore_eos,
            length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
        )
        seqs = run_beam_search(self, [ids], beam, params.logprobs or 0, [lora])[0].sequences[: params.n]
        tok = self.llm_engine.tokenizer if params.detokenize else None
        outputs = [
            CompletionOutput(
                index=i,
                text=s.text or "",
                token_ids=s.tokens[len(ids) :],
                cumulative_logprob=s.cum_logprob,
                logprobs=None if params.logprobs is None else token_logprobs(s, len(ids), params.logprobs, tok),
                finish_reason=s.finish_reason,
            )
            for i, s in enumerate(seqs)
        ]
        rid = self.llm_engine.next_request_id()
        return RequestOutput(request_id=rid, prompt=text, prompt_token_ids=ids, outputs=outputs, finished=True)

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def start_profile(self) -> None:
        """vLLM's LLM.start_profile(): the torch profiler runs until stop_profile(), which writes the trace into
        VLLM_TORCH_PROFILER_DIR (a ValueError when it is unset); with several tensor/pipeline-parallel ranks, one
        trace per rank."""
        from pagedllm.profiler import profiler_from_env

        if getattr(self, "_profiler", None) is None:
            self._profiler = profiler_from_env(self.llm_engine)
        self._profiler.start()

    def stop_profile(self) -> None:
        if getattr(self, "_profiler", None) is None:
            raise ValueError("the profiler is not running: start it first (start_profile)")
        self._profiler.stop()

    def get_metrics(self) -> list[Metric]:
        """vLLM's LLM.get_metrics(): Counter / Vector / Gauge / Histogram objects (e.g. vllm:prefix_cache_hits)."""
        return self.llm_engine.get_metrics()

    # -- generate -----------------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        **kwargs: Any,
    ) -> list[RequestOutput]:
        """Generates for every prompt; returns one RequestOutput per prompt, in input order."""
        if self.data_parallel is not None:
            items, kwargs = _as_prompt_list(prompts), dict(kwargs, use_tqdm=use_tqdm)
            params = None if sampling_params is None else _params_list(sampling_params, len(items))  # checked whole
            return self.data_parallel.run(self, "generate", items, (params,), kwargs)
        self._require_generate("generate")
        unknown = set(kwargs) - {"lora_request", "priority"}
        if unknown:
            raise TypeError(f"generate() got unexpected keyword arguments {sorted(unknown)}")
        if any(kwargs.get("priority") or []):
            raise ValueError("priority: only the default first-come-first-served order is supported")
        if isinstance(prompts, dict) and not {"prompt", "prompt_token_ids", "prompt_embeds"} & set(prompts):
            raise ValueError("prompts: a prompt dict needs a 'prompt', 'prompt_token_ids' or 'prompt_embeds' key")
        prompt_list = _as_prompt_list(prompts)
        enabled = self.llm_engine.config.model.enable_prompt_embeds
        embeds = [embeds_of(p, enabled, f"prompts[{i}]") if isinstance(p, dict) else None
                  for i, p in enumerate(prompt_list)]  # fmt: skip
        parsed = [self._parse_prompt_mm(p, i) if e is None else (None, [], []) for i, (p, e) in
                  enumerate(zip(prompt_list, embeds))]  # fmt: skip
        if not parsed:
            raise ValueError("prompts is empty: give at least one prompt")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = _params_list(sampling_params, len(parsed))
        loras = lora_list(kwargs.get("lora_request"), len(parsed))
        if any(p.use_beam_search for p in params_list):
            if any(e is not None for e in embeds):
                raise ValueError("use_beam_search: beam search takes text or token prompts (no prompt_embeds)")
            if any(features for _, _, features in parsed):
                raise ValueError("use_beam_search: beam search takes text prompts only (no multi_modal_data)")
            pairs = zip(parsed, params_list, loras)
            return [self._beam_search_output(text, ids, p, lora) for (text, ids, _), p, lora in pairs]
        engine = self.llm_engine
        salts = [_cache_salt(p, i) for i, p in enumerate(prompt_list)]
        # Validate every request before any enters the engine.
        pending = [
            engine.make_request(
                text, ids, params, cache_salt=salt, lora_request=lora, mm_features=features, prompt_embeds=e
            )  # fmt: skip
            for (text, ids, features), params, salt, lora, e in zip(parsed, params_list, salts, loras, embeds)
        ]
        return self._run(pending, use_tqdm)

    def chat(
        self,
        messages: list,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: Any = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of {"role", "content"} dicts) or a list of them, rendered with
        the chat template; returns one RequestOutput per conversation, in input order."""
        from pagedllm.entrypoints.chat_utils import as_conversations

        if mm_processor_kwargs is not None and not self._takes_multimodal():
            raise ValueError("mm_processor_kwargs: multimodal inputs are not supported")
        options = dict(
            chat_template=chat_template,
            chat_template_content_format=chat_template_content_format,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
            model_path=self.llm_engine.config.model.model_path,
        )
        prompts = [self._render_chat(conv, options, mm_processor_kwargs) for conv in as_conversations(messages)]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def _pool(self, prompts, params, task, method, use_tqdm, truncate_prompt_tokens, lora_request):
        if self.data_parallel is None:
            return super()._pool(prompts, params, task, method, use_tqdm, truncate_prompt_tokens, lora_request)
        kwargs = dict(use_tqdm=use_tqdm, truncate_prompt_tokens=truncate_prompt_tokens, lora_request=lora_request)
        return self.data_parallel.run(self, "_pool", _pooled_items(prompts), (params, task, method), kwargs)

    def _render_chat(self, conversation: list, options: dict, mm_processor_kwargs: Any) -> dict:
        """One conversation as a TokensPrompt; its images (a model that takes them) already processed."""
        from pagedllm.entrypoints.chat_utils import apply_chat_template

        # None: a text-only (or pooling) model, where an image part is a ValueError
        media = getattr(self.llm_engine, "chat_media", lambda: None)()
        text, ids = apply_chat_template(self.get_tokenizer(), conversation, media=media, **options)
        if media is None or not media.mm_data():
            return {"prompt": text, "prompt_token_ids": ids}
        ids, features = self.llm_engine.process_multimodal(
            text, media.mm_data(), mm_processor_kwargs, add_special_tokens=False, where="messages"
        )
        return ProcessedPrompt(text, ids, features)

    def _parse_prompt_mm(self, prompt: Any, index: int) -> tuple[str | None, list[int], list]:
        """(text, token ids, MultiModalFeatures) of a prompt; a prompt with multi_modal_data goes through the model's
        processor (its image placeholders expanded)."""
        if isinstance(prompt, ProcessedPrompt):
            return prompt["prompt"], prompt["prompt_token_ids"], prompt.mm_features
        if not isinstance(prompt, dict) or prompt.get("multi_modal_data") is None or not self._takes_multimodal():
            return (*self._parse_prompt(prompt, index), [])
        where = f"prompts[{index}]"
        data = prompt["multi_modal_data"]
        for modality, items in data.items() if isinstance(data, dict) else ():
            if items is None or (isinstance(items, (list, tuple)) and any(i is None for i in items)):
                raise ValueError(
                    f"{where}.multi_modal_data[{modality!r}]: an item is None; send every item (media are not "
                    "looked up by multi_modal_uuids)"
                )
        ids, features = self.llm_engine.process_multimodal(
            prompt.get("prompt"), data, prompt.get("mm_processor_kwargs"), where=where
        )
        apply_uuids(features, data, prompt.get("multi_modal_uuids"), where)
        return prompt.get("prompt"), ids, features

    def _takes_multimodal(self) -> bool:
        from pagedllm.multimodal.config import MULTIMODAL_ARCHITECTURES

        return self.llm_engine.config.model.architecture in MULTIMODAL_ARCHITECTURES

    def _parse_prompt(self, prompt: Any, index: int) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self._encode(prompt)
        if isinstance(prompt, dict):
            if prompt.get("prompt_embeds") is not None:  # (generate handles them; beam search not)
                raise ValueError(f"prompts[{index}].prompt_embeds: beam search takes text or token prompts")
            if self._takes_multimodal() and prompt.get("multi_modal_data"):  # (generate handles them; beam search not)
                raise ValueError(f"prompts[{index}].multi_modal_data: beam search takes text prompts only")
            for key in _MULTIMODAL_KEYS if not self._takes_multimodal() else ():
                if prompt.get(key):
                    arch = self.llm_engine.config.model.architecture
                    raise ValueError(
                        f"prompts[{index}].{key}: {arch} is a text-only model; multimodal inputs are not supported"
                    )
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)):
                    raise ValueError(f"prompts[{index}].prompt_token_ids must be a list of ints")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                return prompt["prompt"], self._encode(prompt["prompt"])
            raise ValueError(f"prompts[{index}] must have a str 'prompt' or a list 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise TypeError(
            f"prompts[{index}] has type {type(prompt).__name__}; expected str, TextPrompt, TokensPrompt or list[int]"
        )

    def _encode(self, text: str) -> list[int]:
        tok = self.llm_engine.tokenizer
        if tok is None:
            raise ValueError("text prompts need a tokenizer; with skip_tokenizer_init=True pass prompt_token_ids")
        return tok.encode(text)

    def _run(self, pending: list, use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        order: dict[str, int] = {}
        results: list[RequestOutput | None] = [None] * len(pending)
        bar = _ProgressBar(len(pending)) if use_tqdm else None
        # Everything alive now (the model, torch, transformers) stays alive through the run: out of the cyclic
        # collector's reach meanwhile, its collections visit only the run's new objects (else several ms a step).
        gc.freeze()
        try:
            for i, (requests, state) in enumerate(pending):
                state.output_kind = RequestOutputKind.FINAL_ONLY  # whole final outputs, whatever the params ask
                engine.add(requests, state)
                order[state.req_id] = i
            while engine.has_unfinished_requests():
                for out in engine.step_finished():
                    if out.request_id in order:
                        results[order[out.request_id]] = out
                        if bar:
                            bar.update(out)
        except BaseException:
            engine.abort_request([rid for rid, i in order.items() if results[i] is None])
            raise
        finally:
            gc.unfreeze()
            if bar:
                bar.close()
        return results  # type: ignore[return-value]


_MULTIMODAL_KEYS = ("multi_modal_data", "multi_modal_uuids", "mm_processor_kwargs")  # a prompt dict's, as vLLM's


def _as_prompt_list(prompts: Any) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(t, int) for t in prompts):
            return [list(prompts)]  # one prompt given as token ids
        return list(prompts)
    raise TypeError(f"prompts has type {type(prompts).__name__}; expected a str, a prompt dict or a list of them")


def _cache_salt(prompt: Any, index: int) -> str | None:
    """A prompt dict's optional "cache_salt" (vLLM's name): prefix-cache isolation between tenants."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"prompts[{index}].cache_salt={salt!r}: must be a non-empty string")
    return salt


def _params_list(params: Any, n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    if isinstance(params, (list, tuple)):
        if len(params) != n:
            raise ValueError(f"sampling_params has {len(params)} entries but there are {n} prompts")
        if not all(isinstance(p, SamplingParams) for p in params):
            raise TypeError("sampling_params must hold SamplingParams objects")
        return list(params)
    raise TypeError(f"sampling_params has type {type(params).__name__}; expected SamplingParams or a list of them")


class _ProgressBar:
    """Requests done, with input and output tokens per second."""

    def __init__(self, total: int) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(
            total=total,
            desc="Processed prompts",
            dynamic_ncols=True,
            postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s",
        )
        self.start = time.perf_counter()
        self.in_tokens = self.out_tokens = 0

    def update(self, out: RequestOutput) -> None:
        self.in_tokens += len(out.prompt_token_ids or ())  # (None: a prompt of embeddings)
        self.out_tokens += sum(len(c.token_ids) for c in out.outputs)
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.postfix = (
            f"est. speed input: {self.in_tokens / elapsed:.2f} toks/s, output: {self.out_tokens / elapsed:.2f} toks/s"
        )
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
