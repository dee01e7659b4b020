"""GGUF checkpoints with their Q4_0/Q4_1 linear weights kept 4-bit (the loader yields them as PackedQ4).

The C kernel of cpu_quant (without a C compiler, torch's int4 CPU kernel) takes batches of up to MAX_ROWS tokens; the
dense weight kept beside it (the 4-bit rows dequantized into it, with the rows that came dense) takes larger batches,
packed as the dense method packs it."""

from __future__ import annotations

import functools

import torch

from pagedllm.kernels import cpu_quant
from pagedllm.layers.linear import DenseLinearMethod, LinearBase, pack_dense
from pagedllm.layers.q4_linear import MAX_ROWS, PackedQ4, Q4Accumulator, q4_matmul
from pagedllm.layers.quantization.base import LinearMethod, LinearMethodVariant, QuantizationConfig


class Q4LinearMethod(DenseLinearMethod):
    """A dense weight whose loader also takes PackedQ4 tensors; after loading, the int4 kernel's packing when every
    row came 4-bit (layer.q4_weight: packed weight, scales_and_zeros)."""

    def create_weights(self, layer: LinearBase, input_size: int, output_sizes: list[int]) -> None:
        super().create_weights(layer, input_size, output_sizes)
        layer.weight.weight_loader = functools.partial(self.load, layer)
        layer.q4 = None  # the 4-bit shards (a Q4Accumulator) while loading

    def load(self, layer: LinearBase, param: torch.Tensor, loaded: torch.Tensor | PackedQ4, shard_id=None) -> None:
        if not isinstance(loaded, PackedQ4):
            layer.weight_loader(param, loaded, shard_id)
            return
        start, size, _ = layer.output_shard(shard_id) if shard_id is not None else (0, param.shape[0], 0)
        part = layer.rank_part(param, loaded, shard_id)
        if part.shape != (size, layer.input_size_per_partition):
            raise ValueError(f"4-bit tensor of shape {tuple(part.shape)} does not fit rows {start}+{size}")
        if layer.q4 is None:
            layer.q4 = Q4Accumulator(layer.output_size_per_partition, layer.input_size_per_partition)
        layer.q4.put(start, part)

    def process_weights_after_loading(self, layer: LinearBase) -> LinearMethod:
        shards, layer.q4 = layer.q4, None
        q4_weight = shards.finish(layer.weight) if shards is not None else None  # fills the dense weight too
        large = pack_dense(layer)
        if q4_weight is None:
            return large
        layer.q4_weight = q4_weight
        layer.q4_bias = layer.bias.float() if layer.bias is not None else None  # the C kernel adds it in float32
        return Q4KernelMethod(large)


class Q4KernelMethod(LinearMethodVariant):
    """Batches of up to MAX_ROWS tokens through a 4-bit kernel (the C one where the weight is a QuantWeight, else
    torch's int4 kernel), larger ones by `large` (the dense packing)."""

    def __init__(self, large: LinearMethod) -> None:
        self.large = large

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= MAX_ROWS * x.shape[-1]:  # rows <= MAX_ROWS (with no input features: no rows)
            if not isinstance(layer.q4_weight, cpu_quant.QuantWeight):
                out = q4_matmul(x, *layer.q4_weight)
                return out + layer.bias if layer.bias is not None else out
            if cpu_quant.runs(x):  # (float16 takes the dense weight)
                return cpu_quant.quant_linear(x, layer.q4_weight, layer.q4_bias)
        return self.large.apply(layer, x)


Q4_METHOD = Q4LinearMethod()


class GGUFConfig(QuantizationConfig):
    """Every linear layer takes the 4-bit method (a layer whose tensors come dense loads them as the dense one)."""

    name = "gguf"

    def get_linear_method(self, layer: LinearBase, prefix: str) -> LinearMethod | None:
        return Q4_METHOD
