"""Quantization configs by name. Built-in ones are imported when first asked for; others are added with
`register_quantization_config`."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from pagedllm.layers.quantization.base import LinearMethod, LinearMethodVariant, QuantizationConfig

__all__ = [
    "bnb_load_format",
    "LinearMethod",
    "LinearMethodVariant",
    "QuantizationConfig",
    "get_quantization_config",
    "checkpoint_quantization",
    "quantization_config_from_hf",
    "register_quantization_config",
    "resolve_quantization",
    "supported_quantizations",
]

_BUILTIN = {  # name -> (module, class)
    "awq": ("pagedllm.layers.quantization.awq", "AWQConfig"),
    "bitsandbytes": ("pagedllm.layers.quantization.bitsandbytes", "BitsAndBytesConfig"),
    "compressed-tensors": ("pagedllm.layers.quantization.compressed_tensors", "CompressedTensorsConfig"),
    "fp8": ("pagedllm.layers.quantization.fp8", "Fp8Config"),
    "gguf": ("pagedllm.layers.quantization.gguf", "GGUFConfig"),
    "gptq": ("pagedllm.layers.quantization.gptq", "GPTQConfig"),
}
AT_LOAD = ("fp8", "bitsandbytes")  # quantizations `quantization=` applies to a float checkpoint while loading it
_REGISTERED: dict[str, type[QuantizationConfig]] = {}


def register_quantization_config(name: str) -> Callable[[type[QuantizationConfig]], type[QuantizationConfig]]:
    """Class decorator: makes a QuantizationConfig subclass available under `name`."""

    def register(cls: type[QuantizationConfig]) -> type[QuantizationConfig]:
        if name in _BUILTIN:
            raise ValueError(f"quantization {name!r} is built in; choose another name")
        if not (isinstance(cls, type) and issubclass(cls, QuantizationConfig)):
            raise TypeError(f"quantization {name!r} must be a QuantizationConfig subclass, got {cls!r}")
        cls.name = name
        _REGISTERED[name] = cls
        return cls

    return register


def supported_quantizations() -> list[str]:
    return sorted({*_BUILTIN, *_REGISTERED})


def get_quantization_config(name: str) -> type[QuantizationConfig]:
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name not in _BUILTIN:
        raise ValueError(f"quantization {name!r} is not supported; supported: {supported_quantizations()}")
    module, cls_name = _BUILTIN[name]
    return getattr(importlib.import_module(module), cls_name)


def checkpoint_quantization(hf_config: Any) -> str | None:
    """The quant_method a checkpoint's config.json names (None: not quantized). A quantization_config that names
    none (empty, not a mapping, no quant_method) is a ValueError naming the supported formats."""
    raw = getattr(hf_config, "quantization_config", None)
    if raw is None:
        return None
    method = raw.get("quant_method") if isinstance(raw, dict) else getattr(raw, "quant_method", None)
    method = getattr(method, "value", method)  # transformers' QuantizationMethod enum
    if method is None:
        raise ValueError(
            f"config.json quantization_config={raw!r} names no quant_method: a quantized checkpoint names its format "
            f"there (supported: {supported_quantizations()}); an unquantized one has no quantization_config"
        )
    return method


def bnb_load_format(load_format: Any, quantization: Any) -> tuple[Any, Any]:
    """(load_format, quantization) with vLLM's load_format="bitsandbytes" read as "auto" with
    quantization="bitsandbytes" (a bitsandbytes checkpoint, or a float one quantized while loading)."""
    if load_format != "bitsandbytes":
        return load_format, quantization
    if quantization not in (None, "bitsandbytes"):
        raise ValueError(
            f"load_format='bitsandbytes' reads bitsandbytes weights: quantization={quantization!r} must be "
            "'bitsandbytes' or unset"
        )
    return "auto", "bitsandbytes"


def resolve_quantization(requested: Any, hf_config: Any, is_gguf: bool = False) -> str | None:
    """The quantization to load with: the user's `quantization=` (checked against the checkpoint) or the
    checkpoint's own. A ValueError names an unknown format, or one that the checkpoint contradicts."""
    found = "gguf" if is_gguf else checkpoint_quantization(hf_config)
    if requested is None:
        return found
    if not isinstance(requested, str) or requested not in supported_quantizations():
        raise ValueError(f"quantization={requested!r} is not supported; supported: {supported_quantizations()}")
    if found is not None and requested != found:
        raise ValueError(
            f"quantization={requested!r} contradicts the checkpoint, which is quantized as {found!r} "
            f"(config.json quantization_config.quant_method); leave quantization unset or pass {found!r}"
        )
    if found is None and requested not in AT_LOAD:
        raise ValueError(
            f"quantization={requested!r} needs a checkpoint quantized in that format, and this one is not "
            f"quantized; a float checkpoint can be quantized while loading with quantization in {list(AT_LOAD)}"
        )
    return requested


def quantization_config_from_hf(hf_config: Any) -> QuantizationConfig | None:
    """The config named by a checkpoint's `quantization_config` (config.json), or None when it has none."""
    method = checkpoint_quantization(hf_config)
    if method is None:
        return None
    if not isinstance(method, str):
        raise ValueError(
            f"quantization_config.quant_method={method!r} must name a quantization (supported: "
            f"{supported_quantizations()})"
        )
    raw = hf_config.quantization_config
    return get_quantization_config(method).from_config(raw if isinstance(raw, dict) else raw.to_dict())
