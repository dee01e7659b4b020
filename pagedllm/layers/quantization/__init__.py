"""Quantization configs by name. Built-in ones are imported when first asked for; others are added with
`register_quantization_config`."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from pagedllm.layers.quantization.base import LinearMethod, LinearMethodVariant, QuantizationConfig

__all__ = [
    "LinearMethod",
    "LinearMethodVariant",
    "QuantizationConfig",
    "get_quantization_config",
    "quantization_config_from_hf",
    "register_quantization_config",
    "supported_quantizations",
]

_BUILTIN = {"gguf": ("pagedllm.layers.quantization.gguf", "GGUFConfig")}  # name -> (module, class)
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


def quantization_config_from_hf(hf_config: Any) -> QuantizationConfig | None:
    """The config named by a checkpoint's `quantization_config` (config.json), or None when it has none."""
    raw = getattr(hf_config, "quantization_config", None)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raw = raw.to_dict()  # transformers' QuantizationConfigMixin
    method = raw.get("quant_method")
    if not isinstance(method, str):
        raise ValueError(f"quantization_config.quant_method={method!r} must name a quantization")
    return get_quantization_config(method).from_config(raw)
