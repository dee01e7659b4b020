"""Builds the HF config for a resolved model and the pagedllm model with its weights."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.layers.build_context import BuildContext, building
from pagedllm.layers.quantization import QuantizationConfig, get_quantization_config, quantization_config_from_hf
from pagedllm.layers.rope_config import apply_rope_overrides
from pagedllm.model_loader import weights as W
from pagedllm.models.registry import get_model_class
from pagedllm.multimodal.config import MULTIMODAL_ARCHITECTURES

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")
# fields a multimodal config sets at its top level that hold for its text model
_TOP_LEVEL_FIELDS = ("architectures", "bos_token_id", "eos_token_id", "pad_token_id", "dtype", "quantization_config")


def _text_part(config: Any) -> Any:
    """The text config of an image-text checkpoint in MULTIMODAL_ARCHITECTURES, with the top level's fields; else
    `config` itself. The engine sizes everything (vocab, layers, KV heads, context) from it; the model finds the
    whole config in its `vision_language_config`."""
    archs = getattr(config, "architectures", None) or []
    if not archs or archs[0] not in MULTIMODAL_ARCHITECTURES or getattr(config, "text_config", None) is None:
        return config
    text = copy.copy(config.text_config)
    text.vision_language_config = config
    for key in _TOP_LEVEL_FIELDS:
        value = getattr(config, key, None)
        if value is not None:
            setattr(text, key, value)
    return text


def load_hf_config(
    model_path: str,
    trust_remote_code: bool,
    hf_overrides: dict | Callable | None,
    rope_scaling: dict | None = None,
    rope_theta: float | None = None,
) -> Any:
    """The model's HF config with hf_overrides applied, then rope_scaling / rope_theta (vLLM applies a dict of
    overrides with those two, then a callable override). Rope keys in an overrides dict go through
    apply_rope_overrides, so that they work on transformers 5's rope_parameters too."""
    if model_path.endswith(".gguf"):
        from pagedllm.model_loader.gguf_loader import gguf_config

        config = gguf_config(model_path)
    else:
        from transformers import AutoConfig

        config = _text_part(AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code))
    if hf_overrides is not None and not callable(hf_overrides) and not isinstance(hf_overrides, dict):
        raise TypeError(f"hf_overrides must be a dict or a callable, got {type(hf_overrides).__name__}")
    if isinstance(hf_overrides, dict):
        rope = {k: hf_overrides[k] for k in ("rope_scaling", "rope_theta") if k in hf_overrides}
        for key, value in hf_overrides.items():
            if key not in rope:
                setattr(config, key, value)
        apply_rope_overrides(config, **rope, prefix="hf_overrides: ")
    apply_rope_overrides(config, rope_scaling, rope_theta)
    return hf_overrides(config) if callable(hf_overrides) else config


def _weights(model_config: ModelConfig):
    fmt = model_config.load_format
    if fmt == "auto":
        fmt = W.detect_format(model_config.model_path)
    if fmt == "gguf":
        from pagedllm.model_loader.gguf_loader import gguf_weights

        return gguf_weights(model_config.model_path, keep_q4=model_config.keep_q4)
    if fmt == "safetensors":
        return W.safetensors_weights(model_config.model_path)
    if fmt == "pt":
        return W.pt_weights(model_config.model_path)
    raise ValueError(f"load_format={fmt!r} must be one of {LOAD_FORMATS}")


def quant_config_of(model_config: ModelConfig) -> QuantizationConfig | None:
    """GGUF with 4-bit tensors kept packed, else the checkpoint's quantization_config, else the quantization asked
    for at load (`quantization="fp8"` or "bitsandbytes" of a float checkpoint); None: dense."""
    if model_config.keep_q4:
        return get_quantization_config("gguf")()
    found = quantization_config_from_hf(model_config.hf_config)
    if found is None and model_config.quantization == "fp8":
        from pagedllm.layers.quantization.fp8 import Fp8Config

        return Fp8Config.dynamic()
    if found is None and model_config.quantization == "bitsandbytes":
        from pagedllm.layers.quantization.bitsandbytes import BitsAndBytesConfig

        return BitsAndBytesConfig.in_flight()
    return found


def get_model(model_config: ModelConfig, device: torch.device, context: BuildContext | None = None) -> nn.Module:
    """The model on `device`, built for this rank's shard (`context`; default one rank) and its weights loaded (each
    parameter copies its slice of the checkpoint tensor)."""
    context = context if context is not None else BuildContext()
    cls = get_model_class(model_config.architecture, model_config.model_impl)
    if context.tp_size > 1 and not getattr(cls, "supports_tensor_parallel", False):
        raise ValueError(
            f"tensor_parallel_size={context.tp_size}: {model_config.architecture} does not support tensor "
            "parallelism in pagedllm yet"
        )
    if context.pp_size > 1 and not getattr(cls, "supports_pipeline_parallel", False):
        raise ValueError(
            f"pipeline_parallel_size={context.pp_size}: {model_config.architecture} does not support pipeline "
            "parallelism in pagedllm yet"
        )
    quant_config = quant_config_of(model_config)
    model = build_model(model_config, device, context, quant_config)
    if model_config.load_format == "dummy":
        W.dummy_init(model, model_config.seed)
    else:
        weights = _weights(model_config)
        loaded = model.load_weights(quant_config.checkpoint_weights(weights) if quant_config else weights)
        expected = {n for n, _ in model.named_parameters()}
        missing = expected - loaded
        if missing:
            raise ValueError(f"checkpoint {model_config.model_path!r} lacks weights for {sorted(missing)[:8]}")
    for module in model.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    logger.info("%s", weights_summary(model))
    return model.eval()


def build_model(model_config: ModelConfig, device: torch.device, context: BuildContext, quant_config=None) -> nn.Module:
    """The model's modules for `context`'s shard on `device`, weights not loaded (on the meta device: the layers'
    names and shapes alone, as LoRA checks an adapter against the stages other ranks hold). quant_config: the one
    the weights will be loaded with (default: the model's own)."""
    cls = get_model_class(model_config.architecture, model_config.model_impl)
    quant_config = quant_config if quant_config is not None else quant_config_of(model_config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(model_config.dtype)
    try:
        with torch.device(device), building(context):
            return cls(model_config.hf_config, quant_config, max_position=model_config.max_model_len)
    finally:
        torch.set_default_dtype(previous)


def weights_summary(model: nn.Module) -> str:
    """One line: the weights' memory and, per linear layer kind (its attribute name), the method that runs it."""
    params = {id(p): p for p in model.parameters()}.values()  # tied weights counted once
    buffers = {id(b): b for b in model.buffers()}.values()
    nbytes = sum(t.numel() * t.element_size() for t in (*params, *buffers))
    kinds: dict[str, set[str]] = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None and not isinstance(method, str):
            kinds.setdefault(name.rsplit(".", 1)[-1], set()).add(type(method).__name__)
    methods = ", ".join(f"{kind}: {'/'.join(sorted(m))}" for kind, m in sorted(kinds.items()))
    return f"weights {nbytes / 2**30:.2f} GiB; linear methods: {methods or 'none'}"
