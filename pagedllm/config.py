"""The engine's configuration: a tree of validated dataclasses built once in `LLM.__init__`.

Each component receives the sub-config it needs (model, cache, scheduler, parallel, device, compilation).
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.pooling.config import PoolerConfig  # noqa: F401 (importable from here as from vllm.config)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def _require_number(name: str, value: Any, kind: type, optional: bool = False) -> None:
    """TypeError naming the option when it is not a number of the right kind (bool is not a number here)."""
    if value is None and optional:
        return
    kinds = (int, float) if kind is float else (int,)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise TypeError(f"{name}={value!r} must be {'a number' if kind is float else 'an integer'}")


class CompilationLevel(enum.IntEnum):
    """vLLM's compilation levels. pagedllm runs eagerly on CPU; CUDA graphs are governed by `enforce_eager`."""

    NO_COMPILATION = 0
    DYNAMO_AS_IS = 1
    DYNAMO_ONCE = 2
    PIECEWISE = 3


@dataclass
class CompilationConfig:
    level: int = CompilationLevel.NO_COMPILATION
    cudagraph_capture_sizes: list[int] | None = None
    # GPU start-up: threads that compile the Triton kernels of the first steps at once (0: each kernel compiles
    # when first launched; None: up to 8, one per CPU core)
    compile_threads: int | None = None
    # capture the decode graphs of batch sizes <= 8 and of the largest size at start, the others when first used
    lazy_cudagraph_capture: bool = False

    def __post_init__(self) -> None:
        if int(self.level) not in {lvl.value for lvl in CompilationLevel}:
            raise ValueError(f"compilation_config.level={self.level!r} is not one of 0, 1, 2, 3")
        if self.compile_threads is None:
            self.compile_threads = min(8, os.cpu_count() or 1)
        if isinstance(self.compile_threads, bool) or not isinstance(self.compile_threads, int):
            raise TypeError(f"compilation_config.compile_threads={self.compile_threads!r} must be an integer")
        if not 0 <= self.compile_threads <= 64:
            raise ValueError(f"compilation_config.compile_threads={self.compile_threads} must be in [0, 64]")
        if not isinstance(self.lazy_cudagraph_capture, bool):
            raise TypeError(
                f"compilation_config.lazy_cudagraph_capture={self.lazy_cudagraph_capture!r} must be True or False"
            )
        if self.cudagraph_capture_sizes is not None:
            sizes = list(self.cudagraph_capture_sizes)
            if any(not isinstance(s, int) or s < 1 for s in sizes):
                raise ValueError(f"compilation_config.cudagraph_capture_sizes={sizes!r} must hold positive integers")
            self.cudagraph_capture_sizes = sorted(set(sizes))

    @classmethod
    def from_user(cls, value: Any) -> CompilationConfig:
        if value is None:
            return cls()
        if isinstance(value, CompilationConfig):
            return value
        if isinstance(value, int):
            return cls(level=value)
        if isinstance(value, dict):
            known = {"level", "mode", "cudagraph_capture_sizes", "compile_threads", "lazy_cudagraph_capture"}
            unknown = set(value) - known
            if unknown:
                raise TypeError(f"compilation_config has unknown keys {sorted(unknown)}; known: {sorted(known)}")
            level = value.get("level", value.get("mode", CompilationLevel.NO_COMPILATION))
            return cls(
                level=level,
                cudagraph_capture_sizes=value.get("cudagraph_capture_sizes"),
                compile_threads=value.get("compile_threads"),
                lazy_cudagraph_capture=value.get("lazy_cudagraph_capture", False),
            )
        raise TypeError(f"compilation_config must be an int, a dict or a CompilationConfig, got {type(value).__name__}")


def resolve_seed(seed: Any) -> int:
    """The engine's seed; None (vLLM's "no fixed seed", the examples' default) draws a random one."""
    if seed is None:
        import secrets

        return secrets.randbits(63)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ValueError(f"seed={seed!r} must be None or an integer in [0, 2**64)")
    return seed


@dataclass
class ModelConfig:
    """What the model is and how to run it. `hf_config` is the transformers config after `hf_overrides`."""

    model: str  # what the user asked for
    model_path: str  # resolved local directory or .gguf file
    tokenizer: str | None  # resolved tokenizer location (None: from the model / GGUF)
    hf_config: Any
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    seed: int = 0
    load_format: str = "auto"  # auto | safetensors | pt | gguf | dummy
    trust_remote_code: bool = False
    skip_tokenizer_init: bool = False
    keep_q4: bool = False  # GGUF Q4_0/Q4_1 weights stay 4-bit for the int4 kernel (CPU, half-precision compute)
    quantization: str | None = None  # the checkpoint's quant_method, or one applied at load ("fp8", "bitsandbytes")
    generation_config: str = "auto"  # "auto": the model's generation_config.json; "vllm": none; or a path
    override_generation_config: dict | None = None  # generation_config keys over the chosen source's
    runner: str = "generate"  # "generate" | "pooling" (embeddings, classifiers: no KV cache, no sampler)
    pooler: Any = None  # pooling.config.PoolingSpec of a pooling model
    model_impl: str = "pagedllm"  # resolved: "pagedllm" (native class) | "transformers" (the fallback)
    enable_prompt_embeds: bool = False  # prompts may be input embeddings (pagedllm/prompt_embeds.py)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    @property
    def num_kv_heads(self) -> int:
        from pagedllm.models.utils import num_kv_heads_of

        if self._mla:
            return self._mla_cache_dims()[0]
        return num_kv_heads_of(self.hf_config)

    @property
    def head_dim(self) -> int:
        from pagedllm.models.utils import head_dim_of

        if self._mla:
            return self._mla_cache_dims()[1]
        return head_dim_of(self.hf_config)

    @property
    def _mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3): the cache holds per-head K and V of the model's own dims."""
        return getattr(self.hf_config, "kv_lora_rank", None) is not None

    def _mla_cache_dims(self) -> tuple[int, int]:
        from pagedllm.models.deepseek_v2 import mla_cache_dims

        return mla_cache_dims(self.hf_config)


# kv_cache_dtype -> the cache's torch dtype (None: the model's dtype); "fp8" is E4M3, as in vLLM
KV_CACHE_DTYPES = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


@dataclass
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    cache_dtype: str = "auto"  # kv_cache_dtype: one of KV_CACHE_DTYPES
    num_blocks: int = 0  # decided when the cache is allocated

    def __post_init__(self) -> None:
        if not isinstance(self.cache_dtype, str) or self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.cache_dtype!r} must be one of {list(KV_CACHE_DTYPES)}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ValueError(f"block_size={self.block_size!r} must be a power of two in [1, 256]")
        _require_number("gpu_memory_utilization", self.gpu_memory_utilization, float)
        _require_number("num_gpu_blocks_override", self.num_gpu_blocks_override, int, optional=True)
        _require_number("kv_cache_memory_bytes", self.kv_cache_memory_bytes, int, optional=True)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization!r} must be in (0, 1]")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override={self.num_gpu_blocks_override!r} must be >= 1")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes={self.kv_cache_memory_bytes!r} must be >= 1")

    def kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype the KV cache is stored in."""
        return KV_CACHE_DTYPES[self.cache_dtype] or model_dtype


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    # schedule step N+1 while step N runs on the device (its sampled tokens stay there as N+1's inputs)
    async_scheduling: bool = False
    max_loras: int | None = None  # distinct LoRA adapters among the running requests (None: LoRA is off)
    # a prompt chunk longer than this is cut to it (0: off), so steps with long prefills stay short for the decodes
    long_prefill_token_threshold: int = 0
    chunked_prefill: bool = True  # False: a prompt waits for a step with budget for all of it

    def __post_init__(self) -> None:
        _require_number("max_num_seqs", self.max_num_seqs, int)
        _require_number("long_prefill_token_threshold", self.long_prefill_token_threshold, int)
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold={self.long_prefill_token_threshold!r} must be >= 0 (0: off)"
            )
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling={self.async_scheduling!r} must be True, False or None (auto)")
        _require_number("max_num_batched_tokens", self.max_num_batched_tokens, int)
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs!r} must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens!r} must be >= 1")
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is below max_model_len={self.max_model_len} "
                "with enable_chunked_prefill=False (a prompt must fit in one step): raise max_num_batched_tokens "
                "or lower max_model_len"
            )
        if not self.chunked_prefill and self.long_prefill_token_threshold:
            raise ValueError(
                f"long_prefill_token_threshold={self.long_prefill_token_threshold} cuts prompts into chunks, "
                "which enable_chunked_prefill=False turns off: give one of them"
            )


EXECUTOR_BACKENDS = (None, "mp", "ray", "uni")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # None: "uni" for one rank, else "mp" (processes on this machine), or "ray" when a Ray cluster is reached and
    # this machine has fewer GPUs than the ranks need
    distributed_executor_backend: str | None = None
    distributed_timeout_s: float = 10.0  # a collective waiting longer on a peer (gloo) fails the step
    disable_custom_all_reduce: bool = False  # True: every GPU all-reduce through NCCL (no one-shot kernel)

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend={self.distributed_executor_backend!r} must be one of {EXECUTOR_BACKENDS}"
            )
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError(
                f"distributed_executor_backend='uni' runs one rank, not tensor_parallel_size * "
                f"pipeline_parallel_size = {self.world_size}"
            )
        if not self.distributed_timeout_s > 0:
            raise ValueError(f"distributed_timeout_s={self.distributed_timeout_s!r} must be > 0")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass
class DeviceConfig:
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    enforce_eager: bool = False
    attention_backend: str = "auto"  # auto: triton on CUDA (when installed), torch elsewhere

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r} must be one of {ATTENTION_BACKENDS}")
        if self.attention_backend == "triton" and self.device.type != "cuda":
            raise ValueError(f"attention_backend='triton' runs on CUDA devices only, not device={str(self.device)!r}")


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: DeviceConfig
    compilation: CompilationConfig
    # internal, off by default: a spec_decode Proposer whose drafts the engine verifies each step (synchronous
    # scheduling only)
    speculative_proposer: Any = None
    speculative_config: Any = None  # the user's SpeculativeConfig (spec_decode/config.py), None: no speculation
    lora: Any = None  # LoRAConfig (lora/config.py); None: LoRA is off
    multimodal: Any = None  # multimodal.MultiModalConfig (limits, processor options, encoder cache size)
    guided_decoding_backend: str = "auto"  # structured outputs' default backend: auto | xgrammar | guidance
    logits_processors: tuple = ()  # engine-wide LogitsProcessor classes (sample/custom_logits.py); the driver's

    # vLLM's names (VllmConfig.model_config, ...) of the parts, as its scripts and logits processors read them
    model_config = property(lambda self: self.model)
    cache_config = property(lambda self: self.cache)
    scheduler_config = property(lambda self: self.scheduler)
    parallel_config = property(lambda self: self.parallel)
    device_config = property(lambda self: self.device)
    compilation_config = property(lambda self: self.compilation)
    lora_config = property(lambda self: self.lora)


VllmConfig = EngineConfig  # vLLM's name, as its logits processors' signatures import it


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def parse_dtype(
    dtype: str | torch.dtype, config_dtype: torch.dtype | None, device: torch.device, quantized: bool = False
) -> torch.dtype:
    """vLLM's `dtype` rule. "auto" on GPU: the checkpoint's half-precision dtype, float32 checkpoints in bfloat16.
    "auto" on CPU: bfloat16 where the CPU computes it natively and the checkpoint is half precision or quantized
    (GGUF), else float32."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype={dtype!r} must be one of auto, float32, float16, bfloat16")
        return dtype
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a str or torch.dtype, got {type(dtype).__name__}")
    if dtype == "auto":
        resolved = config_dtype if config_dtype in _DTYPES.values() else torch.float32
        if device.type == "cpu":
            half = quantized or resolved in (torch.float16, torch.bfloat16)
            return torch.bfloat16 if half and cpu_has_bf16() else torch.float32
        return torch.bfloat16 if resolved == torch.float32 else resolved
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} must be one of auto, float32, float16, bfloat16")
    return _DTYPES[dtype]
