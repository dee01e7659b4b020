"""The linear-layer seam: a `LinearMethod` owns a linear layer's weights (their creation, their processing after
loading) and its matmul; a `QuantizationConfig` picks the method of each layer by the layer's dotted name."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from pagedllm.layers.linear import LinearBase


class LinearMethod(ABC):
    """How one linear layer stores and applies its weight. Methods keep no per-layer state: what they create or
    pack lives on the layer, so one method object may serve many layers."""

    @abstractmethod
    def create_weights(self, layer: LinearBase, input_size: int, output_sizes: list[int]) -> None:
        """Registers this rank's parameters on `layer`: `input_size` input features, `sum(output_sizes)` output
        rows (one entry per merged projection). Each parameter carries `weight_loader(param, loaded, shard_id=None)`
        (usually `layer.weight_loader`) and, for that loader, `output_dim` / `input_dim`: which of its dims holds
        the output rows / the input features (None: not split)."""

    def process_weights_after_loading(self, layer: LinearBase) -> LinearMethod:
        """Called once when every weight is in. Returns the method that applies from now on: this one, or a variant
        chosen for what loading found (a packing for this CPU, a kernel for this shape)."""
        return self

    @abstractmethod
    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features] with the layer's bias (if any) added."""


class LinearMethodVariant(LinearMethod):
    """A method that `process_weights_after_loading` chose: the layer's weights are already made and processed."""

    def create_weights(self, layer: LinearBase, input_size: int, output_sizes: list[int]) -> None:
        raise TypeError(f"{type(self).__name__} is chosen after loading; build the layer with its loading method")


class QuantizationConfig(ABC):
    """A checkpoint's quantization: which method each linear layer takes."""

    name: str = ""  # the registry's name for it (the checkpoint's quantization_config["quant_method"])

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        """Built from the checkpoint's `quantization_config` (config.json); configs without fields ignore it."""
        return cls()

    @abstractmethod
    def get_linear_method(self, layer: LinearBase, prefix: str) -> LinearMethod | None:
        """The method of the linear layer named `prefix` (e.g. "model.layers.0.self_attn.qkv_proj"); None: dense."""

    def checkpoint_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's (name, tensor) stream as the layers' parameters take it: a format that stores one weight
        in several tensors (bitsandbytes) decodes them here; the others pass it through."""
        return weights
