"""GPTQ checkpoints (quant_method "gptq", as AutoGPTQ / GPTQModel / optimum write them): 4- or 8-bit weights with a
scale and zero point per group of input features, optionally in act order (desc_act: g_idx gives each input
feature's group).

Tensors of a linear layer with K inputs, N outputs, G groups (pack = 32 / bits values per int32 word, value i of a
word at bits [i * bits, (i + 1) * bits)):
  qweight int32 [K / pack, N]   packed along K: input feature k of output n in word k // pack, position k % pack
  qzeros  int32 [G, N / pack]   packed along N: output n's zero point in word n // pack, position n % pack
  scales  fp16  [G, N]
  g_idx   int32 [K]             the group of each input feature (k // group_size without act order)
w[k, n] = (q[k, n] - zero[g_idx[k], n]) * scale[g_idx[k], n]. checkpoint_format "gptq" (the original format) stores
each zero point minus one (zero = stored + 1, as AutoGPTQ's kernels read it, without wrapping); "gptq_v2" stores it
as it is."""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.layers.linear import LinearBase
from pagedllm.layers.quantization.base import LinearMethod, QuantizationConfig
from pagedllm.layers.quantization.int_packing import pack_factor, unpack_int32
from pagedllm.layers.quantization.wna16 import (
    Unpacked,
    WNA16LinearMethod,
    check_bits,
    check_group_size,
    not_converted,
    take,
)

FORMATS = ("gptq", "gptq_v2")


class GPTQLinearMethod(WNA16LinearMethod):
    def __init__(self, bits: int, group_size: int, zero_offset: int) -> None:
        super().__init__(bits, group_size)
        self.zero_offset = zero_offset  # 1: the original format's zero points minus one

    def create_format_weights(self, layer: LinearBase, k: int, n: int) -> None:
        pack, groups = pack_factor(self.bits), self.num_groups(k)
        if k % pack:
            raise ValueError(f"{layer.prefix}: gptq {self.bits}-bit weights need input features divisible by {pack}")
        layer.qweight = self.param(layer, k // pack, n, dtype=torch.int32, output_dim=1, unit=pack)
        layer.qzeros = self.param(layer, groups, -(-n // pack), dtype=torch.int32, output_dim=1, pack=pack)
        layer.scales = self.param(layer, groups, n, dtype=torch.float32, output_dim=1)
        layer.g_idx = self.g_idx_param(layer, k)

    def unpack(self, layer: LinearBase) -> Unpacked:
        qweight, qzeros, scales, g_idx = take(layer, "qweight", "qzeros", "scales", "g_idx")
        n = scales.shape[1]
        q = unpack_int32(qweight, self.bits, dim=0)  # [K, N]
        zeros = unpack_int32(qzeros, self.bits, dim=1)[:, :n] + self.zero_offset  # [G, N]
        return Unpacked(q, zeros, scales, g_idx)


class GPTQConfig(QuantizationConfig):
    """Every linear layer GPTQ-quantized, except `modules_to_not_convert` (checkpoint module names)."""

    name = "gptq"

    def __init__(self, bits: int, group_size: int, checkpoint_format: str = "gptq", skip: list[str] | None = None):
        self.method = GPTQLinearMethod(bits, group_size, 1 if checkpoint_format == "gptq" else 0)
        self.skip = list(skip or [])

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GPTQConfig:
        bits = check_bits(config.get("bits"), (4, 8), "gptq")
        group_size = check_group_size(config.get("group_size", -1), "gptq")
        fmt = config.get("checkpoint_format") or "gptq"
        if fmt not in FORMATS:
            raise ValueError(
                f"gptq: quantization_config.checkpoint_format={fmt!r} is not supported (supported: {list(FORMATS)})"
            )
        for key in ("is_marlin_format", "lm_head", "dynamic"):
            if config.get(key):
                raise ValueError(f"gptq: quantization_config.{key}={config[key]!r} is not supported")
        return cls(bits, group_size, fmt, config.get("modules_to_not_convert"))

    def get_linear_method(self, layer: LinearBase, prefix: str) -> LinearMethod | None:
        if not_converted(prefix, self.skip):
            return None
        return self.method
