"""vLLM engine options that pagedllm accepts for compatibility: each is either a no-op (pagedllm's design makes it
moot, any value is accepted) or supported only at the value that matches pagedllm's design (another value is a
ValueError naming why). They are fields of CompatArgs, which EngineArgs extends, so they are LLM keywords and serve
flags like the others; the rule of each lives in its field's metadata (one definition)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from pagedllm import envs
from pagedllm.config import ATTENTION_BACKENDS

_UNSET = (None, "", {}, [])  # what "not given" looks like in a keyword, a flag or a config file


def _noop(default: Any, why: str) -> Any:
    return field(default=default, metadata={"compat": ("no-op", lambda v: True, why)})


def _only(default: Any, why: str, *also: Any) -> Any:
    """Only `default` (or one of `also`) is accepted; a value that means "unset" counts as the default."""
    allowed = (default, *also)

    def accepts(value: Any) -> bool:
        if any(value is u or value == u for u in _UNSET):
            return True
        return any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in allowed)

    return field(default=default, metadata={"compat": ("only", accepts, why)})


_SPEC = "speculative decoding is configured by speculative_config"
_EP = "no expert parallelism: MoE experts are split by tensor parallelism"
_DP = "data parallelism runs replicas of one process (data_parallel_size); no multi-node ranks"
_MM = "multimodal inputs are processed per request"


@dataclass(kw_only=True)
class CompatArgs:
    use_v2_block_manager: bool = _noop(True, "one block manager: the paged KV cache")
    num_scheduler_steps: int = _noop(1, "each step is scheduled; async scheduling overlaps host work")
    multi_step_stream_outputs: bool = _noop(True, "every step streams")
    max_seq_len_to_capture: int = _noop(8192, "CUDA graphs are captured by batch size, any length")
    max_context_len_to_capture: int | None = _noop(None, "older name of max_seq_len_to_capture")
    disable_async_output_proc: bool = _noop(False, "outputs are processed on the engine's thread")
    scheduler_delay_factor: float = _noop(0.0, "requests are scheduled as soon as they come")
    swap_space: float = _noop(4, "no CPU swap: preempted requests are recomputed")
    max_parallel_loading_workers: int | None = _noop(None, "weights load in one pass")
    code_revision: str | None = _noop(None, "no remote code is downloaded")
    tokenizer_pool_size: int = _noop(0, "the server tokenizes in its preparation threads")
    tokenizer_pool_type: str = _noop("ray", "the server tokenizes in its preparation threads")
    tokenizer_pool_extra_config: dict | None = _noop(None, "the server tokenizes in its preparation threads")
    num_lookahead_slots: int = _noop(0, "speculative decoding reserves the slots its drafts need")
    disable_cascade_attn: bool = _noop(False, "no cascade attention: shared prefixes use the prefix cache")
    intial_incremental_detokenization_offset: int = _noop(5, "detokenization is incremental from the first token")
    disable_mm_preprocessor_cache: bool = _noop(False, _MM)
    mm_processor_cache_gb: float = _noop(4, _MM)
    mm_processor_cache_type: str | None = _noop(None, _MM)
    mm_shm_cache_max_object_size_mb: int = _noop(128, _MM)
    skip_mm_profiling: bool = _noop(False, "the cache is sized without a multimodal profiling run")
    disable_chunked_mm_input: bool = _noop(False, "an image's tokens are never split across steps")
    disable_hybrid_kv_cache_manager: bool = _noop(False, "one KV-cache manager for every attention kind")
    kv_sharing_fast_prefill: bool = _noop(False, "no cross-layer KV sharing")
    max_long_partial_prefills: int = _noop(1, "one token budget for all prefills")
    aggregate_engine_logging: bool = _noop(False, "the server's stats line covers its one engine")
    show_hidden_metrics_for_version: str | None = _noop(None, "no metric is hidden: seed-era and current names")
    use_tqdm_on_load: bool = _noop(True, "weights load without a progress bar")
    safetensors_load_strategy: str = _noop("lazy", "safetensors files are memory-mapped")
    speculative_disable_mqa_scorer: bool | None = _noop(False, "drafts are scored in one batched forward")
    disable_logprobs_during_spec_decoding: bool | None = _noop(None, "logprobs are the target model's")
    all2all_backend: str | None = _noop(None, _EP)
    expert_placement_strategy: str = _noop("linear", _EP)
    eplb_window_size: int = _noop(1000, _EP)
    eplb_step_interval: int = _noop(3000, _EP)
    eplb_log_balancedness: bool = _noop(False, _EP)
    dbo_decode_token_threshold: int = _noop(32, "no dual-batch overlap")
    dbo_prefill_token_threshold: int = _noop(512, "no dual-batch overlap")
    disable_nccl_for_dp_synchronization: bool = _noop(False, _DP)
    lora_extra_vocab_size: int = _noop(256, "adapters keep the base vocabulary")
    mamba_cache_dtype: str = _noop("auto", "no Mamba models")
    mamba_ssm_cache_dtype: str = _noop("auto", "no Mamba models")
    mamba_block_size: int | None = _noop(None, "no Mamba models")
    served_model_name: str | None = _noop(None, "the server's --served-model-name names the model; offline: none")
    reasoning_parser: str | None = _noop(None, "the server's --reasoning-parser splits replies; offline: none")
    # supported at one value only
    preemption_mode: str | None = _only(None, "preemption recomputes; no swapping", "recompute")
    tokenizer_mode: str = _only("auto", "Hugging Face tokenizers only ('auto')", "hf")
    config_format: str = _only("auto", "configs in Hugging Face format only ('auto')", "hf")
    cpu_offload_gb: float = _only(0, "weights are not offloaded to CPU memory")
    disable_sliding_window: bool = _only(False, "sliding-window models always use their window")
    scheduling_policy: str = _only("fcfs", "requests are served first come, first served")
    enable_sleep_mode: bool = _only(False, "no sleep mode")
    otlp_traces_endpoint: str | None = _only(None, "no OpenTelemetry tracing")
    collect_detailed_traces: str | None = _only(None, "no OpenTelemetry tracing")
    enable_expert_parallel: bool = _only(False, _EP)
    enable_eplb: bool = _only(False, _EP)
    eplb_config: dict | None = _only(None, _EP)
    num_redundant_experts: int = _only(0, _EP)
    enable_dbo: bool = _only(False, "no dual-batch overlap")
    decode_context_parallel_size: int = _only(1, "no context parallelism")
    data_parallel_rank: int | None = _only(None, _DP)
    data_parallel_start_rank: int | None = _only(None, _DP)
    data_parallel_size_local: int | None = _only(None, _DP)
    data_parallel_address: str | None = _only(None, _DP)
    data_parallel_rpc_port: int | None = _only(None, _DP)
    data_parallel_hybrid_lb: bool = _only(False, _DP)
    data_parallel_backend: str = _only("mp", _DP)
    calculate_kv_scales: bool = _only(False, "FP8 KV-cache scales are not computed at run time")
    interleave_mm_strings: bool = _only(False, "chat content is text parts and media parts")
    mm_encoder_tp_mode: str = _only("weights", "the vision encoder's weights are split by tensor parallelism")
    mm_encoder_attn_backend: str | None = _only(None, "the vision encoder uses torch attention")
    io_processor_plugin: str | None = _only(None, "no input/output processor plugins")
    video_pruning_rate: float = _only(0.0, "no video token pruning")
    enable_multimodal_encoder_data_parallel: bool = _only(False, "the vision encoder runs with tensor parallelism")
    allowed_media_domains: list[str] | None = _only(None, "no domain allow-list for media URLs")
    hf_config_path: str | None = _only(None, "the config is read from the model's directory")
    kv_transfer_config: dict | None = _only(None, "no disaggregated prefill (KV transfer between engines)")
    kv_events_config: dict | None = _only(None, "no KV-cache event publishing")
    worker_cls: str = _only("auto", "the worker class follows the device")
    worker_extension_cls: str = _only("", "the worker class follows the device")
    scheduler_cls: str | None = _only(None, "one scheduler (engine/scheduler.py)")
    model_loader_extra_config: dict | None = _only(None, "the loaders take no extra options")
    pt_load_map_location: str = _only("cpu", ".bin checkpoints load to CPU, then move to the device")
    additional_config: dict | None = _only(None, "no platform plugins read it")
    override_neuron_config: dict | None = _only(None, "no Neuron devices")
    quantization_param_path: str | None = _only(None, "FP8 KV-cache scales are not read from a file")
    worker_use_ray: bool = _only(False, "older name: use distributed_executor_backend='ray'")
    engine_use_ray: bool = _only(False, "the engine runs in the caller's process")
    override_attention_dtype: str | None = _only(None, "attention runs in the model's dtype")
    ray_workers_use_nsight: bool = _only(False, "no Nsight profiling of Ray workers")
    logits_processor_pattern: str | None = _only(None, "requests cannot name logits processor classes")
    logprobs_mode: str = _only("raw_logprobs", "logprobs are of the model's raw distribution")
    max_logprobs: int = _only(20, "the most logprobs a request may ask for is 20 (server: --max-logprobs)")
    max_num_partial_prefills: int = _only(1, "one token budget for all prefills")
    prefix_caching_hash_algo: str = _only("builtin", "prefix-cache blocks are keyed by Python's hash", "sha256")
    enable_lora_bias: bool = _only(False, "LoRA adapters with bias terms are not supported")
    long_lora_scaling_factors: list[float] | None = _only(None, "no long-context LoRA")
    default_mm_loras: dict | None = _only(None, "no per-modality default LoRA adapters")
    qlora_adapter_name_or_path: str | None = _only(None, "QLoRA adapters are loaded as LoRA adapters")
    enable_prompt_adapter: bool = _only(False, "no prompt adapters")
    max_prompt_adapters: int = _only(1, "no prompt adapters")
    max_prompt_adapter_token: int = _only(0, "no prompt adapters")
    speculative_model_quantization: str | None = _only(None, _SPEC)
    speculative_draft_tensor_parallel_size: int | None = _only(None, _SPEC, 1)
    spec_decoding_acceptance_method: str = _only("rejection_sampler", "drafts are verified by rejection sampling")
    typical_acceptance_sampler_posterior_threshold: float | None = _only(None, "no typical acceptance sampler")
    typical_acceptance_sampler_posterior_alpha: float | None = _only(None, "no typical acceptance sampler")
    guided_decoding_disable_fallback: bool | None = _only(None, "structured outputs use the chosen backend", False)
    guided_decoding_disable_any_whitespace: bool | None = _only(None, "the backend's whitespace rules", False)
    guided_decoding_disable_additional_properties: bool | None = _only(None, "JSON schemas as given", False)


# name -> (kind, which values are accepted, why); kind "no-op": every value, "only": the values `accepts` allows
COMPAT_ARGS: dict[str, tuple[str, Callable[[Any], bool], str]] = {
    f.name: f.metadata["compat"] for f in fields(CompatArgs) if "compat" in f.metadata
}
# server-side names: the commands define their own flags (nargs, choices), LLM takes them as keywords
SERVER_FLAGS = ("served_model_name", "reasoning_parser", "max_logprobs")


def check_compat_args(values: dict[str, Any]) -> None:
    """ValueError for a compatibility option set to a value pagedllm does not support."""
    for name, (kind, accepts, why) in COMPAT_ARGS.items():
        value = values.get(name)
        if name in values and kind == "only" and not accepts(value):
            raise ValueError(f"{name}={value!r} is not supported: {why}")


# vLLM's attention backend names: its GPU kernels are pagedllm's Triton kernels, its CPU ones the torch backend
_VLLM_ATTENTION = {
    **dict.fromkeys(("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "XFORMERS", "FLEX_ATTENTION"), "triton"),
    **dict.fromkeys(("TORCH_SDPA", "CPU_ATTN"), "torch"),
}


def attention_backend(name: str, device: torch.device) -> str:
    """pagedllm's backend (auto | torch | triton) for attention_backend, which may be one of vLLM's names; `auto`
    takes VLLM_ATTENTION_BACKEND when that is set."""
    source = "attention_backend"
    found = envs.attention_backend() if name == "auto" else None
    if found is not None:
        source, name = found
    ours = _VLLM_ATTENTION.get(str(name).upper())
    if ours is None:
        if found is not None and name not in ATTENTION_BACKENDS:
            raise ValueError(
                f"{source}={name!r} is not an attention backend: allowed {ATTENTION_BACKENDS + tuple(_VLLM_ATTENTION)}"
            )
        return name  # pagedllm's own names: DeviceConfig checks them
    if ours == "triton" and device.type != "cuda":
        raise ValueError(
            f"{source}={name!r} is a GPU backend (pagedllm's Triton kernels) and device={str(device)!r} is not a "
            "CUDA device: use 'auto' or 'torch'"
        )
    return ours
