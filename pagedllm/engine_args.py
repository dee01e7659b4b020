"""EngineArgs: the user-facing engine options (vLLM's names), turned into the validated EngineConfig tree."""

from __future__ import annotations

import argparse
import json
import logging
from argparse import SUPPRESS
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from pagedllm.config import (
    CacheConfig,
    CompilationConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    parse_dtype,
    resolve_seed,
)
from pagedllm.engine_checks import check_kv_cache_dtype, check_max_model_len, check_not_quantized
from pagedllm.engine_compat import SERVER_FLAGS, CompatArgs, attention_backend, check_compat_args
from pagedllm.layers.q4_linear import q4_kernel_available
from pagedllm.layers.quantization import bnb_load_format, resolve_quantization
from pagedllm.layers.rope_config import check_rope_keywords, rope_max_len
from pagedllm.model_loader.loader import LOAD_FORMATS, load_hf_config
from pagedllm.model_loader.resolve import default_embedding_model_path, resolve_model
from pagedllm.model_loader.weights import check_load_format
from pagedllm.models.registry import resolve_model_impl
from pagedllm.multimodal.config import MultiModalConfig
from pagedllm.pooling.config import resolve_pooling, wants_pooling
from pagedllm.sample.custom_logits import engine_processors
from pagedllm.spec_decode import NgramProposer, SpeculativeConfig
from pagedllm.spec_decode.draft_model import draft_model_config
from pagedllm.worker.cpu_threads import bind_cpu_threads
from pagedllm.worker.cuda_graphs import capture_sizes

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_MAX_NUM_SEQS = 256
_SHORT_FLAGS = {
    "tensor_parallel_size": ("-tp",),
    "pipeline_parallel_size": ("-pp",),
    "data_parallel_size": ("-dp",),
    "quantization": ("-q",),
}
# commands take the model as MODEL (and --model) and define the server-side names themselves
_NOT_CLI_FLAGS = ("model", *SERVER_FLAGS)
logger = logging.getLogger(__name__)


@dataclass
class EngineArgs(CompatArgs):
    """vLLM's engine keywords; the compatibility ones (no-ops, or one supported value) come from CompatArgs."""

    model: str | None = None
    tokenizer: str | None = None
    revision: str | None = None
    tokenizer_revision: str | None = None  # unset: `revision`
    download_dir: str | None = None  # the HF cache directory for downloaded models (unset: HF's default)
    hf_token: str | bool | None = None  # the Hub token of downloads (unset: HF_TOKEN; True: the saved login)
    ignore_patterns: str | list[str] | None = None  # files a download skips (besides original/*)
    dtype: str | torch.dtype = "auto"
    seed: int | None = 0  # None: a random engine seed, and the global generators are left alone
    max_model_len: int | None = None
    max_num_seqs: int | None = None  # None: 256
    max_num_batched_tokens: int | None = None
    long_prefill_token_threshold: int = 0  # prompt chunks cut to this many tokens a step (0: off)
    enable_chunked_prefill: bool | None = None  # False: a prompt is computed in one step (None: chunked)
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    async_scheduling: bool | None = None  # None: on for CUDA devices, where it overlaps host and device work
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None | "mp" | "ray" | "uni" (distributed/)
    data_parallel_size: int = 1  # engine replicas splitting an offline call's prompts (entrypoints/data_parallel)
    trust_remote_code: bool = False
    skip_tokenizer_init: bool = False
    hf_overrides: Any = None
    rope_scaling: dict | None = None  # replaces the config's rope scaling, e.g. {"rope_type": "yarn", "factor": 4.0}
    rope_theta: float | None = None
    load_format: str = "auto"
    quantization: str | None = None  # None: the checkpoint's; "fp8" / "bitsandbytes": quantize a float one at load
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | fp8 | fp8_e4m3 | fp8_e5m2 (CUDA, Triton attention)
    enable_prefix_caching: bool = True
    compilation_config: Any = None
    cudagraph_capture_sizes: list[int] | None = None  # decode batch sizes captured as CUDA graphs (compilation_config)
    cuda_graph_sizes: list[int] | None = None  # vLLM's older name of cudagraph_capture_sizes
    max_cudagraph_capture_size: int | None = None  # capture the default sizes up to this one only
    device: str | None = None
    generation_config: str = "auto"
    override_generation_config: dict | None = None  # sampling defaults over generation_config's, e.g. {"top_k": 5}
    attention_backend: str = "auto"  # auto | torch | triton, or vLLM's names (FLASH_ATTN, TORCH_SDPA, ...)
    task: str = "auto"  # auto | generate | embed | classify | score (vLLM's older name for runner + convert)
    runner: str = "auto"  # auto | generate | pooling
    convert: str = "auto"  # auto | none | embed | classify
    pooler_config: Any = None  # PoolerConfig or dict(pooling_type=..., normalize=...)
    override_pooler_config: Any = None  # vLLM's older name of pooler_config
    model_impl: str = "auto"  # auto | pagedllm (alias vllm) | transformers (models/transformers_fallback.py)
    speculative_config: Any = None  # dict, e.g. {"method": "ngram", "num_speculative_tokens": 4} (spec_decode/config)
    speculative_model: str | None = None  # vLLM's older keywords: "[ngram]" ...
    num_speculative_tokens: int | None = None
    ngram_prompt_lookup_max: int | None = None
    ngram_prompt_lookup_min: int | None = None
    speculative_disable_by_batch_size: int | None = None  # no drafts above this many requests
    speculative_max_model_len: int | None = None  # no drafts for a request past this length
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: Any = "auto"
    fully_sharded_loras: bool = False
    limit_mm_per_prompt: dict | None = None  # e.g. {"image": 2}: more items in one prompt is a ValueError
    mm_processor_kwargs: dict | None = None  # passed to the model's transformers processor for every prompt
    allowed_local_media_path: str = ""  # chat image_url file:// paths are read only under this directory
    enable_mm_embeds: bool = False  # multi_modal_data may carry precomputed image embeddings (torch tensors)
    enable_prompt_embeds: bool = False  # prompts may be input embeddings ({"prompt_embeds": tensor})
    media_io_kwargs: dict | None = None  # {"image": {"rgba_background_color": [R, G, B]}}: under transparent pixels
    disable_log_stats: bool = False  # the server's periodic stats line (offline LLM logs none)
    disable_log_requests: bool = False  # the server's per-request log lines
    disable_custom_all_reduce: bool = False  # GPU all-reduces all through NCCL (no one-shot kernel for small ones)
    guided_decoding_backend: str = "auto"  # structured outputs: auto | xgrammar | guidance (structured_output/)
    structured_outputs_config: dict | None = None  # vLLM's current form: {"backend": ...} (overrides the above)
    logits_processors: list[str] | None = None  # LogitsProcessor classes or "pkg.mod:Class" (sample/custom_logits)

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser | Any) -> argparse.ArgumentParser:
        """One --flag-name per field (vLLM's spelling and short forms -tp, -pp, -q), typed from the field's
        annotation: booleans as --flag / --no-flag, lists as several values, dicts and Any as JSON. Absent flags
        keep the defaults. A flag the parser already has is the command's own (serve's MODEL / --model,
        --served-model-name, ...) and is left to it. `parser` may be an argument group."""
        taken = set(parser._option_string_actions)
        group = parser
        if not isinstance(parser, argparse._ArgumentGroup):
            group = parser.add_argument_group("engine", "the engine's arguments (EngineArgs, LLM's keywords)")
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            if flag in taken:
                continue
            flags = [flag, *(o for o in _SHORT_FLAGS.get(f.name, ()) if o not in taken)]
            kind = _flag_type(f.type)
            if kind is bool:
                group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=SUPPRESS)
            elif isinstance(kind, list):  # list[int] -> --flag 1 2 4 (vLLM's form)
                group.add_argument(*flags, dest=f.name, type=kind[0], nargs="+", default=SUPPRESS)
            else:
                kind = human_readable_int if f.name in _HUMAN_READABLE_INTS else kind
                group.add_argument(*flags, dest=f.name, type=kind, default=SUPPRESS)
        if "--structured-outputs-config.backend" not in taken:  # vLLM's dotted form of one config key
            group.add_argument("--structured-outputs-config.backend", dest="guided_decoding_backend", default=SUPPRESS)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """EngineArgs of every field the namespace holds (vLLM's form: scripts that parse add_cli_args' flags)."""
        return cls(**{name: getattr(args, name) for name in cls.names() if hasattr(args, name)})

    @classmethod
    def cli_kwargs(cls, args: argparse.Namespace) -> dict[str, Any]:
        """The engine keywords a pagedllm command's line gave: the fields add_cli_args made flags for, less the
        ones the command defines itself (MODEL, --served-model-name, ...)."""
        return {name: getattr(args, name) for name in cls.names() if name not in _NOT_CLI_FLAGS and hasattr(args, name)}

    def _device(self) -> torch.device:
        return parse_device(self.device)

    def create_model_config(self, device: torch.device) -> ModelConfig:
        load_format, requested = bnb_load_format(self.load_format, self.quantization)
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format={load_format!r} must be one of {(*LOAD_FORMATS, 'bitsandbytes')}")
        pooling_default = self.model is None and wants_pooling(self.task, self.runner, self.convert)
        if pooling_default:
            path = default_embedding_model_path()
        else:
            hub = {"token": self.hf_token, "ignore_patterns": self.ignore_patterns}
            path = resolve_model(self.model, self.revision, self.download_dir, **hub)
        hf_config = load_hf_config(path, self.trust_remote_code, self.hf_overrides, self.rope_scaling, self.rope_theta)
        check_rope_keywords(hf_config, self.rope_scaling, self.rope_theta)
        archs = getattr(hf_config, "architectures", None) or []
        if not archs:
            raise ValueError(f"model {path!r}: config.json names no `architectures`")
        model_impl = resolve_model_impl(archs[0], self.model_impl)
        check_not_quantized(path, hf_config)
        quantization = resolve_quantization(requested, hf_config, is_gguf=path.endswith(".gguf"))
        check_load_format(path, load_format)
        config_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(config_dtype, str):
            config_dtype = getattr(torch, config_dtype, None)
        user_pooler = self.pooler_config if self.pooler_config is not None else self.override_pooler_config
        pooling = resolve_pooling(path, hf_config, archs[0], self.task, self.runner, self.convert, user_pooler)
        runner, pooler, trained_len = pooling
        if runner == "pooling" and model_impl == "transformers":
            raise ValueError(f"model_impl={self.model_impl!r}: the transformers fallback runs generative models only")
        derived_len = int(getattr(hf_config, "max_position_embeddings", 2048))
        derived_len = min(derived_len, trained_len or derived_len)
        longest = rope_max_len(hf_config, derived_len)
        max_len = longest if self.max_model_len is None else self.max_model_len
        if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1:
            raise ValueError(f"max_model_len={self.max_model_len!r} must be a positive integer")
        check_max_model_len(max_len, longest)
        is_gguf = path.endswith(".gguf")
        dtype = parse_dtype(self.dtype, config_dtype, device, quantized=is_gguf)
        keep_q4 = (
            is_gguf
            and device.type == "cpu"
            and dtype != torch.float32
            and load_format != "dummy"
            and model_impl == "pagedllm"  # the fallback runs dense weights
            and q4_kernel_available()
        )
        return ModelConfig(
            model=self.model or path,
            model_path=path,
            tokenizer=self.tokenizer,
            hf_config=hf_config,
            architecture=archs[0],
            dtype=dtype,
            max_model_len=max_len,
            seed=resolve_seed(self.seed),
            load_format=load_format,
            trust_remote_code=self.trust_remote_code,
            skip_tokenizer_init=self.skip_tokenizer_init,
            keep_q4=keep_q4,
            quantization=quantization,
            generation_config=self.generation_config,
            override_generation_config=self.override_generation_config,
            runner=runner,
            pooler=pooler,
            model_impl=model_impl,
            enable_prompt_embeds=self.enable_prompt_embeds,
        )

    def create_engine_config(self) -> EngineConfig:
        check_compat_args(vars(self))
        parallel = ParallelConfig(
            self.tensor_parallel_size,
            self.pipeline_parallel_size,
            self.distributed_executor_backend,
            disable_custom_all_reduce=self.disable_custom_all_reduce,
        )
        compilation = self._compilation_config()
        device = self._device()
        speculative = SpeculativeConfig.from_user(
            self.speculative_config,
            self.speculative_model,
            self.num_speculative_tokens,
            self.ngram_prompt_lookup_max,
            self.ngram_prompt_lookup_min,
            self.speculative_disable_by_batch_size,
            self.speculative_max_model_len,
        )
        model = self.create_model_config(device)
        if speculative is not None and speculative.method == "draft_model":
            speculative.draft_model_config = draft_model_config(speculative, model)
        elif speculative is not None and speculative.method in ("eagle", "eagle3"):
            from pagedllm.spec_decode.eagle import eagle_model_config

            speculative.draft_model_config = eagle_model_config(speculative, model)
        if device.type == "cpu":
            bind_cpu_threads()  # VLLM_CPU_OMP_THREADS_BIND, before the model loads
        cache = CacheConfig(
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            enable_prefix_caching=self.enable_prefix_caching,
            cache_dtype=self.kv_cache_dtype,
        )
        attention = attention_backend(self.attention_backend, device)
        check_kv_cache_dtype(cache.cache_dtype, device, attention, model.runner)
        scheduler = SchedulerConfig(
            max_num_seqs=DEFAULT_MAX_NUM_SEQS if self.max_num_seqs is None else self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens
            or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, model.max_model_len if self.enable_chunked_prefill is False else 0),
            max_model_len=model.max_model_len,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            chunked_prefill=self.enable_chunked_prefill is not False,
            # with speculation: asynchronous steps (no drafts) only above disable_by_batch_size (engine/core.py)
            async_scheduling=device.type == "cuda"
            and (speculative is None or speculative.disable_by_batch_size is not None)
            if self.async_scheduling is None
            else self.async_scheduling,
        )
        lora = self.create_lora_config(model)
        scheduler.max_loras = lora.max_loras if lora is not None else None
        multimodal = MultiModalConfig.from_user(
            self.limit_mm_per_prompt,
            self.mm_processor_kwargs,
            self.allowed_local_media_path,
            self.enable_mm_embeds,
            self.media_io_kwargs,
        )
        if multimodal.text_only(model.architecture) and hasattr(model.hf_config, "vision_language_config"):
            model.hf_config.mm_text_only = True  # every modality 0: the vision tower is neither built nor loaded
        return EngineConfig(
            model,
            cache,
            scheduler,
            parallel,
            # the fallback runs eagerly: HF forwards are not checked to be CUDA-graph safe (host syncs, masks)
            DeviceConfig(device, self.enforce_eager or model.model_impl == "transformers", attention),
            compilation,
            # a draft model runs in the model runner: the engine core proposes through the executor
            speculative_proposer=NgramProposer(speculative) if speculative and speculative.method == "ngram" else None,
            speculative_config=speculative,
            lora=lora,
            multimodal=multimodal,
            guided_decoding_backend=self._guided_decoding_backend(),
            logits_processors=engine_processors(self.logits_processors, speculative, parallel, model),
        )

    def _compilation_config(self) -> CompilationConfig:
        """compilation_config, with the CUDA-graph sizes of the top-level keywords (vLLM's two spellings)."""
        compilation = CompilationConfig.from_user(self.compilation_config)
        sizes = self.cudagraph_capture_sizes if self.cudagraph_capture_sizes is not None else self.cuda_graph_sizes
        if sizes is not None and self.cuda_graph_sizes is not None and self.cuda_graph_sizes != sizes:
            raise ValueError(f"cudagraph_capture_sizes={sizes!r} and cuda_graph_sizes={self.cuda_graph_sizes!r} "
                             "differ: give one")  # fmt: skip
        cap = self.max_cudagraph_capture_size
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"max_cudagraph_capture_size={cap!r} must be a positive integer")
        if sizes is not None:
            compilation = replace(compilation, cudagraph_capture_sizes=list(sizes))
        if cap is not None:
            seqs = DEFAULT_MAX_NUM_SEQS if self.max_num_seqs is None else self.max_num_seqs
            chosen = compilation.cudagraph_capture_sizes or capture_sizes(seqs, None)
            compilation = replace(compilation, cudagraph_capture_sizes=[s for s in chosen if s <= cap] or [cap])
        return compilation

    def _guided_decoding_backend(self) -> str:
        from pagedllm.structured_output.manager import check_backend

        config = self.structured_outputs_config
        if config is not None:
            if not isinstance(config, dict) or set(config) - {"backend"}:
                raise ValueError(f"structured_outputs_config={config!r}: a dict with the one key 'backend'")
            backend = config.get("backend", "auto")
            check_backend(backend, "structured_outputs_config.backend")
            return backend
        check_backend(self.guided_decoding_backend, "guided_decoding_backend")
        return self.guided_decoding_backend

    def create_lora_config(self, model: ModelConfig):
        """The LoRAConfig with enable_lora=True (None without)."""
        if not self.enable_lora:
            return None
        from pagedllm.lora.config import LoRAConfig, parse_lora_dtype

        if model.model_impl != "pagedllm":
            raise ValueError(f"enable_lora=True: model_impl={model.model_impl!r} has no LoRA layers (use 'pagedllm')")
        if self.fully_sharded_loras and self.tensor_parallel_size == 1:
            logger.info("fully_sharded_loras has no effect with tensor_parallel_size=1")
        return LoRAConfig(
            self.max_loras, self.max_lora_rank, self.max_cpu_loras, parse_lora_dtype(self.lora_dtype, model.dtype)
        )


def parse_device(device: str | torch.device | None) -> torch.device:
    """The device to run on: None / "auto" picks CUDA when torch sees a GPU, else the CPU. A ValueError names a
    device this torch cannot run on."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    allowed = "'auto', 'cpu', 'cuda' or 'cuda:N'"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r} is not a device: allowed {allowed}") from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is not supported: allowed {allowed}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise ValueError(
                f"device={device!r}: torch sees no CUDA GPU (torch {torch.__version__}, {build}); use device='cpu' "
                "or install a CUDA build of torch on a machine with an NVIDIA GPU"
            )
        count = torch.cuda.device_count()
        if dev.index is not None and not 0 <= dev.index < count:
            raise ValueError(
                f"device={device!r}: this machine has {count} CUDA GPU(s): allowed cuda:0 to cuda:{count - 1}"
            )
    return dev


_HUMAN_READABLE_INTS = ("max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes")
_DECIMAL, _BINARY = (
    {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12},
    {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40},
)


def human_readable_int(text: str) -> int:
    """vLLM's sizes on the command line: 2048, 25.6k (decimal: k m g t, fractions allowed), 32K (binary: K M G T,
    whole numbers only)."""
    text = text.strip()
    try:
        if text[-1:] in _DECIMAL:
            return int(float(text[:-1]) * _DECIMAL[text[-1]])
        if text[-1:] in _BINARY:
            return int(text[:-1]) * _BINARY[text[-1]]
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number: e.g. 2048, 25.6k (decimal k, m, g, t) or 32K (binary K, M, G, T)"
        ) from None


def _json_flag(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None


def _flag_type(annotation: Any) -> Any:
    """The argparse type of a field from its annotation (a string here): the first type that is not None; a list
    of scalars is [type] (several values after the flag)."""
    first = next(p.strip() for p in str(annotation).split("|") if p.strip() != "None")
    scalars = {"bool": bool, "int": int, "float": float, "str": str}
    if first.startswith("list[") and first[5:-1] in scalars:
        return [scalars[first[5:-1]]]
    return scalars.get(first, _json_flag)
