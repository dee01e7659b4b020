"""AWQ checkpoints (quant_method "awq", version "gemm", as AutoAWQ writes them): 4-bit weights with a scale and zero
point per group of input features.

Tensors of a linear layer with K inputs, N outputs, G groups, 8 values per int32 word packed along N in AWQ's
interleaved order: position i (bits [4 i, 4 i + 4)) of word j holds output 8 j + AWQ_ORDER[i], AWQ_ORDER =
(0, 2, 4, 6, 1, 3, 5, 7):
  qweight int32 [K, N / 8]
  qzeros  int32 [G, N / 8]   (the same packing; zero points as they are)
  scales  fp16  [G, N]
w[k, n] = (q[k, n] - zero[k // group_size, n]) * scale[k // group_size, n]."""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.layers.linear import LinearBase
from pagedllm.layers.quantization.base import LinearMethod, QuantizationConfig
from pagedllm.layers.quantization.int_packing import AWQ_ORDER, unpack_int32
from pagedllm.layers.quantization.wna16 import (
    Unpacked,
    WNA16LinearMethod,
    check_bits,
    check_group_size,
    not_converted,
    take,
)


class AWQLinearMethod(WNA16LinearMethod):
    def create_format_weights(self, layer: LinearBase, k: int, n: int) -> None:
        groups = self.num_groups(k)
        layer.qweight = self.param(layer, k, -(-n // 8), dtype=torch.int32, output_dim=1, pack=8, unit=1)
        layer.qzeros = self.param(layer, groups, -(-n // 8), dtype=torch.int32, output_dim=1, pack=8)
        layer.scales = self.param(layer, groups, n, dtype=torch.float32, output_dim=1)

    def unpack(self, layer: LinearBase) -> Unpacked:
        qweight, qzeros, scales = take(layer, "qweight", "qzeros", "scales")
        n = scales.shape[1]
        q = unpack_int32(qweight, 4, dim=1, order=AWQ_ORDER)[:, :n]  # [K, N]
        zeros = unpack_int32(qzeros, 4, dim=1, order=AWQ_ORDER)[:, :n]  # [G, N]
        return Unpacked(q, zeros, scales, None)


class AWQConfig(QuantizationConfig):
    """Every linear layer AWQ-quantized, except `modules_to_not_convert` (checkpoint module names)."""

    name = "awq"

    def __init__(self, group_size: int, skip: list[str] | None = None) -> None:
        self.method = AWQLinearMethod(4, group_size)
        self.skip = list(skip or [])

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AWQConfig:
        bits = config.get("bits", config.get("w_bit"))
        check_bits(bits, (4,), "awq")
        group_size = check_group_size(config.get("group_size", config.get("q_group_size", 128)), "awq")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"awq: quantization_config.version={version!r} is not supported (supported: 'gemm')")
        if config.get("zero_point", True) is not True:
            raise ValueError("awq: quantization_config.zero_point=False is not supported (supported: True)")
        return cls(group_size, config.get("modules_to_not_convert"))

    def get_linear_method(self, layer: LinearBase, prefix: str) -> LinearMethod | None:
        if not_converted(prefix, self.skip):
            return None
        return self.method
