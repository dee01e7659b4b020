"""Checks of engine options against the model and the device, made before anything loads (each a ValueError
naming the option, its value and what is allowed)."""

from __future__ import annotations

import logging

import torch

from pagedllm import envs

logger = logging.getLogger(__name__)


def check_kv_cache_dtype(cache_dtype: str, device: torch.device, attention_backend: str, runner: str) -> None:
    """An FP8 KV cache is written and read by the Triton attention kernels only: refuse it elsewhere."""
    if cache_dtype == "auto":
        return
    from pagedllm.kernels import triton_available

    where = None
    if device.type != "cuda":
        where = f"device={str(device)!r}"
    elif attention_backend == "torch":
        where = "attention_backend='torch'"
    elif not triton_available():
        where = "this install, which lacks triton"
    elif runner == "pooling":
        where = "a pooling model (its encoder attention keeps no cache)"
    elif cache_dtype != "fp8_e5m2" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(
            f"kv_cache_dtype={cache_dtype!r} (FP8 E4M3) needs a GPU of compute capability 8.9 or newer (Ada, Hopper); "
            f"this one is {torch.cuda.get_device_capability(device)}: use kv_cache_dtype='fp8_e5m2' or 'auto'"
        )
    if where is not None:
        raise ValueError(
            f"kv_cache_dtype={cache_dtype!r} is not supported on {where}: an FP8 KV cache needs a CUDA device and "
            "the Triton attention backend; use kv_cache_dtype='auto'"
        )


def check_not_quantized(path: str, hf_config) -> None:
    """A checkpoint quantized in a format no registered QuantizationConfig reads (HQQ, ...) is
    refused before anything loads, naming the format and the supported ones; a supported one has its
    quantization_config read here, so that a scheme it cannot run is refused before loading too."""
    from pagedllm.layers.quantization import (
        checkpoint_quantization,
        quantization_config_from_hf,
        supported_quantizations,
    )

    method = checkpoint_quantization(hf_config)
    if method is None:
        return
    supported = supported_quantizations()
    if method in supported:
        quantization_config_from_hf(hf_config)
        return
    raise ValueError(
        f"model {path!r} is quantized (config.json quantization_config.quant_method={method!r}): this quantization "
        f"method is not supported yet (supported: {supported}); use an unquantized checkpoint (float32, float16 or "
        "bfloat16) or a GGUF file"
    )


def check_max_model_len(max_len: int, longest: int) -> None:
    if max_len <= longest:
        return
    allowed = envs.allow_long_max_model_len()
    if allowed is not None:
        logger.warning(
            "max_model_len=%d is longer than the model's %d (%s is set): outputs past %d tokens may be wrong",
            max_len, longest, allowed, longest,
        )  # fmt: skip
        return
    raise ValueError(
        f"max_model_len={max_len} is out of range: [1, {longest}] (the model's max_position_embeddings or "
        "trained length, in its config, times its rope scaling factor); a longer one may give wrong outputs or "
        "fail. To allow it anyway, set the environment variable VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (or "
        "PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN=1)"
    )
