"""compressed-tensors' "pack-quantized" weight-only integer schemes (W4A16 / W8A16, as llm-compressor writes them):
int weights of 4 or 8 bits with a scale per output channel or per group of input features, symmetric or with zero
points, activations not quantized.

Tensors of a linear layer with K inputs, N outputs, G groups (pack = 32 / bits values per int32 word, value i of a
word at bits [i * bits, (i + 1) * bits); each value stored unsigned: the signed int plus 2**(bits - 1)):
  weight_packed     int32 [N, ceil(K / pack)]   packed along K, row by row (a row's last word zero-padded)
  weight_scale      [N, G]                       (G = 1: channel-wise)
  weight_zero_point int32 [ceil(N / pack), G]   packed along N (asymmetric schemes only)
  weight_shape      [2]                          (N, K)
  weight_g_idx      int32 [K]                    the group of each input feature (actorder "group" only)
w[n, k] = (q[n, k] - zero[n, g(k)]) * scale[n, g(k)] (symmetric: zero 2**(bits - 1), the signed int times scale)."""

from __future__ import annotations

import torch

from pagedllm.layers.linear import LinearBase
from pagedllm.layers.quantization.int_packing import pack_factor, unpack_int32
from pagedllm.layers.quantization.wna16 import (
    SHARD_INDEX,
    Unpacked,
    WNA16LinearMethod,
    check_bits,
    check_group_size,
    take,
)

ACT_ORDERS = (None, "weight", "static", "group", "dynamic")  # "group" / "dynamic": a g_idx per layer


def check_shape(layer: LinearBase, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    """weight_shape: the projection's whole (rows, input features) (of every rank), checked against the layer's."""
    rows = layer.output_size if shard_id is None else layer.output_sizes[SHARD_INDEX.get(shard_id, shard_id)]
    if loaded.tolist() != [rows, layer.input_size]:
        raise ValueError(f"{layer.prefix}: weight_shape {loaded.tolist()} does not fit {[rows, layer.input_size]}")


class CTPackedLinearMethod(WNA16LinearMethod):
    def __init__(self, bits: int, group_size: int, symmetric: bool, g_idx: bool) -> None:
        super().__init__(bits, group_size)
        self.symmetric, self.has_g_idx = symmetric, g_idx

    def create_format_weights(self, layer: LinearBase, k: int, n: int) -> None:
        pack, groups = pack_factor(self.bits), self.num_groups(k)
        layer.weight_packed = self.param(layer, n, -(-k // pack), dtype=torch.int32, output_dim=0, unit=pack)
        layer.weight_scale = self.param(layer, n, groups, dtype=torch.float32, output_dim=0)
        if not self.symmetric:
            layer.weight_zero_point = self.param(
                layer, -(-n // pack), groups, dtype=torch.int32, output_dim=0, pack=pack
            )
        layer.weight_shape = self.per_projection(layer, 2, dtype=torch.int64, dummy=lambda t: None)
        layer.weight_shape.weight_loader = lambda param, loaded, shard_id=None: check_shape(
            layer, param, loaded, shard_id
        )
        if self.has_g_idx:
            layer.weight_g_idx = self.g_idx_param(layer, k)

    def unpack(self, layer: LinearBase) -> Unpacked:
        packed, scale = take(layer, "weight_packed", "weight_scale")
        n, k = layer.output_size_per_partition, layer.input_size_per_partition
        q = unpack_int32(packed, self.bits, dim=1)[:, :k].t()  # [K, N]
        zeros = None
        if not self.symmetric:
            (zero_point,) = take(layer, "weight_zero_point")
            zeros = unpack_int32(zero_point, self.bits, dim=0)[:n].t()  # [G, N]
        (g_idx,) = take(layer, "weight_g_idx") if self.has_g_idx else (None,)
        del layer.weight_shape
        return Unpacked(q, zeros, scale.t(), g_idx)


def ct_int_method(weights: dict, where: str) -> CTPackedLinearMethod:
    """The method of a group's int weight args (already known to be type "int"), or a ValueError naming the field."""
    fmt = "compressed-tensors"
    bits = check_bits(weights.get("num_bits"), (4, 8), fmt, f"{where}.num_bits")
    strategy = weights.get("strategy")
    if strategy == "channel":
        group_size = -1
    elif strategy == "group":
        group_size = check_group_size(weights.get("group_size"), fmt, f"{where}.group_size")
    else:
        raise ValueError(
            f"{fmt}: quantization_config {where}.strategy={strategy!r} is not supported for int weights "
            "(supported: 'channel', 'group')"
        )
    if weights.get("dynamic", False):
        raise ValueError(f"{fmt}: quantization_config {where}.dynamic=True is not supported for weights")
    actorder = weights.get("actorder")
    if actorder not in ACT_ORDERS:
        raise ValueError(f"{fmt}: quantization_config {where}.actorder={actorder!r} is not supported ({ACT_ORDERS})")
    symmetric = weights.get("symmetric", True)
    return CTPackedLinearMethod(bits, group_size, bool(symmetric), actorder in ("group", "dynamic"))
