"""vLLM engine options that pagedllm accepts for compatibility: each is either a no-op (pagedllm's design makes it
moot, any value is accepted) or supported only at the value that matches pagedllm's design (another value is a
ValueError naming why). They are EngineArgs fields like the others, so they are LLM keywords and serve flags too."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# name -> (kind, which values are accepted, why); kind "no-op": every value, "only": the values `accepts` allows
COMPAT_ARGS: dict[str, tuple[str, Callable[[Any], bool], str]] = {
    "use_v2_block_manager": ("no-op", lambda v: True, "one block manager: the paged KV cache"),
    "num_scheduler_steps": ("no-op", lambda v: True, "each step is scheduled; async scheduling overlaps host work"),
    "max_seq_len_to_capture": ("no-op", lambda v: True, "CUDA graphs are captured by batch size, any length"),
    "max_context_len_to_capture": ("no-op", lambda v: True, "older name of max_seq_len_to_capture"),
    "disable_async_output_proc": ("no-op", lambda v: True, "outputs are processed on the engine's thread"),
    "multi_step_stream_outputs": ("no-op", lambda v: True, "every step streams"),
    "scheduler_delay_factor": ("no-op", lambda v: True, "requests are scheduled as soon as they come"),
    "swap_space": ("no-op", lambda v: True, "no CPU swap: preempted requests are recomputed"),
    "max_parallel_loading_workers": ("no-op", lambda v: True, "weights load in one pass"),
    "code_revision": ("no-op", lambda v: True, "no remote code is downloaded"),
    "tokenizer_pool_size": ("no-op", lambda v: True, "the server tokenizes in its preparation threads"),
    "num_lookahead_slots": ("no-op", lambda v: True, "speculative decoding reserves the slots its drafts need"),
    "disable_cascade_attn": ("no-op", lambda v: True, "no cascade attention: shared prefixes use the prefix cache"),
    "enable_chunked_prefill": ("only", lambda v: v in (None, True), "always on: long prompts are cut into chunks"),
    "preemption_mode": ("only", lambda v: v in (None, "recompute"), "preemption recomputes; no swapping"),
    "tokenizer_mode": ("only", lambda v: v in ("auto", "hf"), "Hugging Face tokenizers only ('auto')"),
    "cpu_offload_gb": ("only", lambda v: not v, "weights are not offloaded to CPU memory"),
    "disable_sliding_window": ("only", lambda v: not v, "sliding-window models always use their window"),
    "scheduling_policy": ("only", lambda v: v == "fcfs", "requests are served first come, first served"),
    "enable_sleep_mode": ("only", lambda v: not v, "no sleep mode"),
    "otlp_traces_endpoint": ("only", lambda v: v is None, "no OpenTelemetry tracing"),
    "collect_detailed_traces": ("only", lambda v: not v, "no OpenTelemetry tracing"),
    "enable_expert_parallel": ("only", lambda v: not v, "MoE experts are split by tensor parallelism"),
    "calculate_kv_scales": ("only", lambda v: not v, "FP8 KV-cache scales are not computed at run time"),
    "enable_prompt_embeds": ("only", lambda v: not v, "prompts are text or token ids, not embeddings"),
    "kv_transfer_config": ("only", lambda v: not v, "no disaggregated prefill (KV transfer between engines)"),
    "worker_cls": ("only", lambda v: v == "auto", "the worker class follows the device"),
    "model_loader_extra_config": ("only", lambda v: not v, "the loaders take no extra options"),
    "additional_config": ("only", lambda v: not v, "no platform plugins read it"),
}


def check_compat_args(values: dict[str, Any]) -> None:
    """ValueError for a compatibility option set to a value pagedllm does not support."""
    for name, (kind, accepts, why) in COMPAT_ARGS.items():
        value = values.get(name)
        if kind == "only" and not accepts(value):
            raise ValueError(f"{name}={value!r} is not supported: {why}")
