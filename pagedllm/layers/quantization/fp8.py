"""FP8 (e4m3) linear layers: checkpoints with `quant_method: "fp8"` (per-tensor `weight_scale`, static `input_scale`
or dynamic activation scales), the FP8 schemes of compressed-tensors (compressed_tensors.py) and `quantization="fp8"`
of a float checkpoint (weights quantized per output channel at load, activations per token on the fly).

On CUDA the weights stay fp8 and each matmul runs through the scaled FP8 GEMM with the activations quantized first
(fp8_ops.fp8_linear). Elsewhere the fp8 weights are dequantized to the compute dtype once, at load, and take the
dense path, with the activations rounded to their fp8 values first: the same numbers the GEMM computes with (and
that transformers computes with on a compressed-tensors checkpoint)."""

from __future__ import annotations

import functools
import re
from typing import Any

import torch
from torch import nn

from pagedllm.layers.linear import DENSE, LinearBase, new_param, pack_dense
from pagedllm.layers.quantization.base import LinearMethod, LinearMethodVariant, QuantizationConfig
from pagedllm.layers.quantization.fp8_ops import (
    FP8_DTYPE,
    dequantize_weight,
    fake_quantize_activations,
    fp8_linear,
    quantize_weight_per_channel,
)

WEIGHT_STRATEGIES = ("tensor", "channel")  # one weight scale per projection / per output row
ACTIVATION_SCHEMES = ("dynamic", "static", "dynamic-tensor", None)  # per token | per tensor from the checkpoint | ...
MERGED_NAMES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
SHARD_INDEX = {"q": 0, "k": 1, "v": 2}


def checkpoint_names(prefix: str) -> list[str]:
    """The checkpoint's module names behind layer `prefix` (a merged layer: one per projection)."""
    parent, _, leaf = prefix.rpartition(".")
    if leaf not in MERGED_NAMES:
        return [prefix]
    return [f"{parent}.{name}" if parent else name for name in MERGED_NAMES[leaf]]


def name_matches(name: str, patterns: list[str]) -> bool:
    """`name` is one of `patterns`: equal, a dotted suffix of it, or matched by a "re:<regex>" entry."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif name == pattern or name.endswith("." + pattern):
            return True
    return False


def layer_matches(prefix: str, patterns: list[str], what: str) -> bool:
    """Whether the projections of layer `prefix` match `patterns`; a merged layer must match all or none."""
    hits = [name_matches(name, patterns) for name in checkpoint_names(prefix)]
    if any(hits) and not all(hits):
        raise ValueError(f"quantization_config {what}={patterns}: {prefix} merges projections quantized differently")
    return all(hits)


def load_scalar_scale(layer: LinearBase, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    """A per-tensor scale (one element) into the slot of its projection; a fused checkpoint tensor fills all."""
    if loaded.numel() != 1:
        raise ValueError(f"{layer.prefix}: a per-tensor scale has one element, got shape {tuple(loaded.shape)}")
    if shard_id is None:
        param.data.fill_(loaded.reshape(()).item())
        return
    param.data[SHARD_INDEX.get(shard_id, shard_id)] = loaded.reshape(())


def load_row_scale(layer: LinearBase, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    """A per-channel scale ([N] or [N, 1]) into its rows."""
    if loaded.dim() == 2 and loaded.shape[1] == 1:
        loaded = loaded[:, 0]
    layer.weight_loader(param, loaded, shard_id)


class Fp8LinearMethod(LinearMethod):
    """Weights fp8 [N, K] with `weight_scale` per projection ("tensor", [num_projections]) or per row ("channel",
    [N]); `input_scale` [num_projections] with static activations. Of a float checkpoint (`serialized=False`) the
    weight loads in the compute dtype and is quantized per row after loading."""

    def __init__(self, weight_strategy: str = "tensor", activations: str | None = "dynamic", serialized=True) -> None:
        if weight_strategy not in WEIGHT_STRATEGIES:
            raise ValueError(f"fp8 weight strategy {weight_strategy!r} must be one of {WEIGHT_STRATEGIES}")
        if activations not in ACTIVATION_SCHEMES:
            raise ValueError(f"fp8 activation scheme {activations!r} must be one of {ACTIVATION_SCHEMES}")
        self.weight_strategy, self.activations, self.serialized = weight_strategy, activations, serialized

    def create_weights(self, layer: LinearBase, input_size: int, output_sizes: list[int]) -> None:
        layer.fp8_compute_dtype = torch.get_default_dtype()
        if not self.serialized:
            DENSE.create_weights(layer, input_size, output_sizes)
            return
        rows, shards, loader = sum(output_sizes), len(output_sizes), layer.weight_loader
        layer.weight = new_param(rows, input_size, dtype=FP8_DTYPE, output_dim=0, input_dim=1, weight_loader=loader)
        scalar = functools.partial(load_scalar_scale, layer)
        if self.weight_strategy == "tensor":  # [num_projections]
            layer.weight_scale = new_param(shards, dtype=torch.float32, weight_loader=scalar)
        else:  # [N]
            row = functools.partial(load_row_scale, layer)
            layer.weight_scale = new_param(rows, dtype=torch.float32, output_dim=0, weight_loader=row)
        if self.activations == "static":  # [num_projections]
            layer.input_scale = new_param(shards, dtype=torch.float32, weight_loader=scalar)

    def loaded_fp8(self, layer: LinearBase) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight fp8 [N, K], scale [N] float32) from what loading put on the layer."""
        if not self.serialized:
            return quantize_weight_per_channel(layer.weight.data)
        scale = layer.weight_scale.data.float()
        if self.weight_strategy == "tensor":
            sizes = torch.tensor(layer.output_partition_sizes, device=scale.device)
            scale = scale.repeat_interleave(sizes)  # [N]
        return layer.weight.data, scale

    def process_weights_after_loading(self, layer: LinearBase) -> LinearMethod:
        weight, scale = self.loaded_fp8(layer)
        input_scale = None
        if self.activations == "static":  # q, k and v (gate and up) share their input: one scale, the largest
            input_scale = layer.input_scale.data.float().max()
            del layer.input_scale
        if self.serialized:
            del layer.weight_scale
        per_tensor_dynamic = self.activations == "dynamic-tensor"
        if weight.device.type != "cuda":
            layer.weight = nn.Parameter(dequantize_weight(weight, scale, layer.fp8_compute_dtype), requires_grad=False)
            dense = pack_dense(layer)
            if self.activations is None:
                return dense
            layer.input_scale = input_scale
            return Fp8EmulatedMethod(dense, per_tensor_dynamic)
        layer.weight = nn.Parameter(weight.contiguous(), requires_grad=False)  # [N, K] fp8
        layer.weight_scale = nn.Parameter(scale.contiguous(), requires_grad=False)  # [N] float32
        layer.input_scale = input_scale  # float32 scalar or None
        return Fp8ScaledMMMethod(per_tensor_dynamic)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{layer.prefix}: fp8 weights run after process_weights_after_loading (the loader calls it)")


class Fp8EmulatedMethod(LinearMethodVariant):
    """Off CUDA: the activations rounded to their fp8 values (as the FP8 GEMM would see them), then `dense` (the
    dequantized weight's dense packing)."""

    def __init__(self, dense: LinearMethod, per_tensor_dynamic: bool = False) -> None:
        self.dense, self.per_tensor_dynamic = dense, per_tensor_dynamic

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        return self.dense.apply(layer, fake_quantize_activations(x, layer.input_scale, self.per_tensor_dynamic))


class Fp8ScaledMMMethod(LinearMethodVariant):
    """CUDA: activations quantized to fp8 (per token, or the static / per-batch scale), the scaled FP8 GEMM."""

    def __init__(self, per_tensor_dynamic: bool = False) -> None:
        self.per_tensor_dynamic = per_tensor_dynamic

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, layer.weight, layer.weight_scale, layer.input_scale, layer.bias, self.per_tensor_dynamic)


class Fp8Config(QuantizationConfig):
    """quant_method "fp8": every linear layer fp8 except `ignored_layers` (checkpoint module names)."""

    name = "fp8"

    def __init__(self, activation_scheme: str = "dynamic", serialized: bool = True, ignored: list[str] | None = None):
        if activation_scheme not in ("dynamic", "static"):
            raise ValueError(
                f"quantization_config.activation_scheme={activation_scheme!r} must be 'dynamic' or 'static'"
            )
        if not serialized and activation_scheme == "static":
            raise ValueError("quantization='fp8' of a float checkpoint takes dynamic activation scales only")
        self.ignored = list(ignored or [])
        weight_strategy = "tensor" if serialized else "channel"
        self.method = Fp8LinearMethod(weight_strategy, activation_scheme, serialized)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Config:
        block = config.get("weight_block_size")
        if block is not None:
            raise ValueError(
                f"quantization_config.weight_block_size={block!r}: block-wise FP8 is not supported yet "
                "(per-tensor weight scales are)"
            )
        ignored = config.get("ignored_layers") or config.get("modules_to_not_convert") or []
        return cls(config.get("activation_scheme", "dynamic"), serialized=True, ignored=ignored)

    @classmethod
    def dynamic(cls) -> Fp8Config:
        """`quantization="fp8"` of a float checkpoint: per-channel fp8 weights, per-token dynamic activations."""
        return cls("dynamic", serialized=False)

    def get_linear_method(self, layer: LinearBase, prefix: str) -> LinearMethod | None:
        if self.ignored and layer_matches(prefix, self.ignored, "ignored_layers"):
            return None
        return self.method
