"""The environment variables pagedllm reads, under vLLM's names; each also as `PAGEDLLM_<name without VLLM_>`
(`PAGEDLLM_API_KEY`, `PAGEDLLM_HF_HUB_OFFLINE`), which wins when both are set. They are read here only, and when
asked (not at import), so a variable set after `import pagedllm` still counts. A bad value is a ValueError naming
the variable, the value and what it may be."""

from __future__ import annotations

import os
from collections.abc import Mapping

_GiB = 1 << 30
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")

# vLLM's name -> (default, meaning): the README's table is written from this
ENV_VARS: dict[str, tuple[str, str]] = {
    "VLLM_API_KEY": ("unset", "the server's API key when `--api-key` is not given"),
    "VLLM_CPU_KVCACHE_SPACE": (
        "4",
        "KV-cache size on CPU in GiB (unset: 4, or a quarter of the free memory if that is less)",
    ),
    "VLLM_CPU_OMP_THREADS_BIND": (
        "auto",
        "CPU cores the engine's threads run on, e.g. `0-7` or `0-3,8-11` (one torch thread each); `auto`: all",
    ),
    "VLLM_LOGGING_LEVEL": ("INFO", "level of pagedllm's log (DEBUG, INFO, WARNING, ERROR)"),
    "VLLM_CONFIGURE_LOGGING": ("1", "0: leave the `pagedllm` logger to the application (no handler is added)"),
    "VLLM_LOGGING_CONFIG_PATH": ("unset", "a JSON file of `logging.config.dictConfig` used instead of the default"),
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN": ("0", "1: allow a max_model_len above the model's (a warning, not an error)"),
    "VLLM_CACHE_ROOT": ("$XDG_CACHE_HOME/pagedllm", "where compiled CPU kernels and GGUF tokenizers are cached"),
    "VLLM_LOG_STATS_INTERVAL": ("10", "seconds between the server's stats lines"),
    "VLLM_TORCH_PROFILER_DIR": (
        "unset",
        "enables LLM.start_profile / stop_profile and the server's /start_profile, /stop_profile; traces go here "
        "(one per rank)",
    ),
    "HF_HUB_OFFLINE": ("0", "1: models only from local paths and the local Hugging Face cache (no download)"),
    "HF_ENDPOINT": ("https://huggingface.co", "the Hugging Face Hub that models are downloaded from"),
    "HF_TOKEN": ("unset", "the Hub token for private and gated models"),
    "VLLM_USE_MODELSCOPE": ("0", "1: download models from ModelScope (needs `pip install modelscope`)"),
    "VLLM_ATTENTION_BACKEND": (
        "unset",
        "attention_backend when it is `auto`: vLLM's names (FLASH_ATTN, FLASHINFER, TRITON_ATTN: the Triton kernels, "
        "CUDA only; TORCH_SDPA: torch) or `auto`, `torch`, `triton`",
    ),
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": ("0", "1: the server's /v1/load_lora_adapter and /v1/unload_lora_adapter"),
    "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": ("5", "seconds the server keeps an idle HTTP connection open"),
    "VLLM_ENABLE_V1_MULTIPROCESSING": (
        "1",
        "0: `LLM(seed=S)` also seeds the caller's `random`, numpy and torch generators, as vLLM's engine does when it "
        "runs in the caller's process (pagedllm's engine always does; the variable only chooses this)",
    ),
    "VLLM_ENABLE_RESPONSES_API_STORE": (
        "0",
        "1: /v1/responses keeps finished responses in memory (any client with the API key may read one by its id) "
        "for previous_response_id and GET /v1/responses/{id}",
    ),
}

_ONE_PROCESS = "the engine runs in the server's (or LLM's) process"
_NO_STATS = "pagedllm collects no usage statistics"
_BUILD = "pagedllm has no build step (Python, Triton and a small C kernel compiled at first use)"
# vLLM's documented variables that pagedllm accepts and ignores (its design makes them moot): name -> why.
# The README's table is written from this.
IGNORED_ENV_VARS: dict[str, str] = {
    "VLLM_USE_V1": "one engine (no V0 / V1 choice)",
    "VLLM_WORKER_MULTIPROC_METHOD": "tensor-parallel workers are always spawned",
    "VLLM_HOST_IP": "no multi-node setup to address: distributed ranks run on one host (or through Ray)",
    "VLLM_PORT": "the workers' ports are picked free at start",
    "VLLM_RPC_BASE_PATH": _ONE_PROCESS,
    "VLLM_RPC_TIMEOUT": _ONE_PROCESS,
    "VLLM_ENGINE_ITERATION_TIMEOUT_S": "an engine step is not timed out",
    "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": "a failed request fails alone; the engine keeps running",
    "VLLM_NO_USAGE_STATS": _NO_STATS,
    "VLLM_DO_NOT_TRACK": _NO_STATS,
    "VLLM_USAGE_SOURCE": _NO_STATS,
    "VLLM_SERVER_DEV_MODE": "no development endpoints",
    "VLLM_TRACE_FUNCTION": "no function tracing",
    "VLLM_NO_DEPRECATION_WARNING": "no deprecation warnings to silence",
    "VLLM_USE_TRITON_FLASH_ATTN": "GPU attention is always Triton (VLLM_ATTENTION_BACKEND chooses the backend)",
    "VLLM_USE_FLASHINFER_SAMPLER": "sampling runs in torch on the device",
    "VLLM_DISABLE_COMPILE_CACHE": "Triton caches its own kernels",
    "VLLM_CONFIG_ROOT": "no configuration files are read from a root folder",
    "VLLM_ASSETS_CACHE": "no assets are downloaded",
    "VLLM_XLA_CACHE_PATH": "no TPU / XLA support",
    "VLLM_CPU_MOE_PREPACK": "CPU MoE weights are used as loaded",
    "VLLM_FUSED_MOE_CHUNK_SIZE": "MoE layers are not chunked",
    "VLLM_LOGITS_PROCESSOR_THREADS": "logits processors run on the engine's thread",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "nothing is unpickled from a socket",
    "VLLM_SKIP_P2P_CHECK": "no peer-to-peer check at start",
    "VLLM_NCCL_SO_PATH": "NCCL comes with torch",
    "VLLM_CUDART_SO_PATH": "the CUDA runtime comes with torch",
    "VLLM_USE_RAY_SPMD_WORKER": "Ray workers are actors driven by the executor",
    "VLLM_USE_RAY_COMPILED_DAG": "Ray workers are actors driven by the executor",
    "VLLM_TARGET_DEVICE": _BUILD,
    "VLLM_MAIN_CUDA_VERSION": _BUILD,
    "VLLM_USE_PRECOMPILED": _BUILD,
    "MAX_JOBS": _BUILD,
    "NVCC_THREADS": _BUILD,
}


def _names(name: str) -> tuple[str, str]:
    return "PAGEDLLM_" + name.removeprefix("VLLM_"), name


def get(name: str, environ: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """(the variable's name as set, its value) for one of ENV_VARS, the PAGEDLLM_ spelling first; None if unset."""
    if name not in ENV_VARS:
        raise KeyError(f"{name} is not one of pagedllm's environment variables: {sorted(ENV_VARS)}")
    env = os.environ if environ is None else environ
    for key in _names(name):
        value = env.get(key)
        if value is not None and value.strip() != "":
            return key, value.strip()
    return None


def _flag(name: str, default: bool, environ: Mapping[str, str] | None = None) -> bool:
    found = get(name, environ)
    if found is None:
        return default
    key, value = found
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise ValueError(f"{key}={value!r} is not a boolean: allowed 1/0, true/false, yes/no, on/off")


def api_key(environ: Mapping[str, str] | None = None) -> str | None:
    found = get("VLLM_API_KEY", environ)
    return None if found is None else found[1]


def cpu_kvcache_space_bytes(environ: Mapping[str, str] | None = None) -> int | None:
    """VLLM_CPU_KVCACHE_SPACE in bytes (the variable is in GiB; fractions allowed), None when unset."""
    found = get("VLLM_CPU_KVCACHE_SPACE", environ)
    if found is None:
        return None
    key, value = found
    try:
        gib = float(value)
    except ValueError:
        gib = -1.0
    if not gib > 0 or gib == float("inf"):
        raise ValueError(f"{key}={value!r} is out of range: a positive number of GiB (e.g. 4 or 0.5)")
    return int(gib * _GiB)


def cpu_omp_threads_bind(environ: Mapping[str, str] | None = None) -> list[int] | None:
    """The CPU ids of VLLM_CPU_OMP_THREADS_BIND ("0-3,8" -> [0, 1, 2, 3, 8]); None for unset, `auto` or `all`."""
    found = get("VLLM_CPU_OMP_THREADS_BIND", environ)
    if found is None or found[1].lower() in ("auto", "all", "nobind"):
        return None
    key, value = found
    cpus: list[int] = []
    try:
        for part in value.split(","):
            first, _, last = part.strip().partition("-")
            lo, hi = int(first), int(last or first)
            if lo < 0 or hi < lo:
                raise ValueError
            cpus.extend(range(lo, hi + 1))
    except ValueError:
        raise ValueError(f"{key}={value!r} is not a CPU list: allowed `auto`, or ids and ranges like 0-3,8") from None
    return sorted(set(cpus))


def logging_level(environ: Mapping[str, str] | None = None) -> str:
    found = get("VLLM_LOGGING_LEVEL", environ)
    if found is None:
        return "INFO"
    key, value = found
    allowed = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
    if value.upper() not in allowed:
        raise ValueError(f"{key}={value!r} is not a log level: allowed {allowed}")
    return value.upper()


def configure_logging(environ: Mapping[str, str] | None = None) -> bool:
    return _flag("VLLM_CONFIGURE_LOGGING", True, environ)


def logging_config_path(environ: Mapping[str, str] | None = None) -> str | None:
    found = get("VLLM_LOGGING_CONFIG_PATH", environ)
    return None if found is None else os.path.expanduser(found[1])


def allow_long_max_model_len(environ: Mapping[str, str] | None = None) -> str | None:
    """The name of the variable that allows a max_model_len above the model's, None if none does."""
    if not _flag("VLLM_ALLOW_LONG_MAX_MODEL_LEN", False, environ):
        return None
    found = get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", environ)
    return found[0] if found else None


def cache_root(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    found = get("VLLM_CACHE_ROOT", environ)
    if found is not None:
        return os.path.expanduser(found[1])
    xdg = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "pagedllm")


def torch_profiler_dir(environ: Mapping[str, str] | None = None) -> str | None:
    found = get("VLLM_TORCH_PROFILER_DIR", environ)
    return None if found is None else os.path.abspath(os.path.expanduser(found[1]))


def hf_hub_offline(environ: Mapping[str, str] | None = None) -> bool:
    return _flag("HF_HUB_OFFLINE", False, environ)


def use_modelscope(environ: Mapping[str, str] | None = None) -> bool:
    return _flag("VLLM_USE_MODELSCOPE", False, environ)


def hf_endpoint(environ: Mapping[str, str] | None = None) -> str | None:
    """HF_ENDPOINT without a trailing slash; None when unset (huggingface_hub's default)."""
    found = get("HF_ENDPOINT", environ)
    return None if found is None else found[1].rstrip("/")


def hf_token(environ: Mapping[str, str] | None = None) -> str | None:
    """HF_TOKEN; None when unset (huggingface_hub then looks for a saved login)."""
    found = get("HF_TOKEN", environ)
    return None if found is None else found[1]


def log_stats_interval(environ: Mapping[str, str] | None = None) -> float:
    found = get("VLLM_LOG_STATS_INTERVAL", environ)
    if found is None:
        return 10.0
    key, value = found
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{key}={value!r} is out of range: a positive number of seconds")
    return seconds


def attention_backend() -> tuple[str, str] | None:
    """(the variable's name as set, its value) of VLLM_ATTENTION_BACKEND; None when unset."""
    return get("VLLM_ATTENTION_BACKEND")


def allow_runtime_lora_updating(environ: Mapping[str, str] | None = None) -> bool:
    return _flag("VLLM_ALLOW_RUNTIME_LORA_UPDATING", False, environ)


def seeds_caller_generators(environ: Mapping[str, str] | None = None) -> bool:
    """VLLM_ENABLE_V1_MULTIPROCESSING=0: vLLM's engine then runs in the caller's process and its seed reaches the
    caller's global generators (vLLM's reproducibility example relies on it)."""
    return not _flag("VLLM_ENABLE_V1_MULTIPROCESSING", True, environ)


def responses_api_store(environ: Mapping[str, str] | None = None) -> bool:
    return _flag("VLLM_ENABLE_RESPONSES_API_STORE", False, environ)


def http_timeout_keep_alive(environ: Mapping[str, str] | None = None) -> float:
    found = get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", environ)
    if found is None:
        return 5.0
    key, value = found
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise ValueError(f"{key}={value!r} is out of range: a number of seconds >= 0")
    return seconds
