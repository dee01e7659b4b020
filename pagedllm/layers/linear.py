"""Linear layers named for tensor parallelism (column / row split). With one rank they are plain matmuls.

Each weight carries a `weight_loader(param, loaded, shard_id=None)` that copies a checkpoint tensor into its slice."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import cpu_kernels
from pagedllm.layers.q4_linear import MAX_ROWS, PackedQ4, Q4Accumulator, q4_matmul

# Batches of up to this many tokens take the AMX tile kernel (cpu_matmul.c): it reads the weights once per call and
# beat oneDNN's matmul at 1-64 rows (one call of each of SmolLM2's linears at 64 rows, weights in cache: 31/22/115/43
# us against 50/38/129/73), and lost to it from 128 rows up (25-35% slower at 2,560: prefill chunks stay on oneDNN).
# Both packings are kept.
TILE_ROWS = 64


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)  # dtype/device from the loading context


def pack_for_cpu(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight reordered for oneDNN's CPU matmul (same results as F.linear, 1.2-2x faster); None off CPU."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)  # 64: the batch size it is tuned for
    except (RuntimeError, AttributeError):
        return None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter {tuple(param.shape)}"
        )
    param.data.copy_(loaded)


class LinearBase(nn.Module):
    use_tiles = True  # whether forward may take the AMX tile kernel (layers that always fuse into oneDNN: False)

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight = _param(output_size, input_size)  # [out_features, in_features]
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = _param(output_size)
            self.bias.weight_loader = self.weight_loader
        self.q4: Q4Accumulator | None = None  # 4-bit shards while loading
        self.q4_weight: tuple[torch.Tensor, torch.Tensor] | None = None  # (packed, scales_and_zeros) after
        self.cpu_weight: torch.Tensor | None = None  # the weight reordered for oneDNN, after loading
        self.cpu_tiles: torch.Tensor | None = None  # also packed for the AMX tile kernel (bfloat16, a CPU with AMX)
        self.tile_bias: torch.Tensor | None = None  # then the bias in float32

    def _shard_range(self, shard_id: object) -> tuple[int, int]:
        return 0, self.output_size

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor | PackedQ4, shard_id: object = None) -> None:
        start, size = self._shard_range(shard_id) if shard_id is not None else (0, param.shape[0])
        if isinstance(loaded, PackedQ4):
            if self.q4 is None:
                self.q4 = Q4Accumulator(self.output_size, self.input_size)
            if loaded.shape != (size, self.input_size):
                raise ValueError(f"4-bit tensor of shape {tuple(loaded.shape)} does not fit rows {start}+{size}")
            self.q4.put(start, loaded)
            return
        default_weight_loader(param.data.narrow(0, start, size) if shard_id is not None else param, loaded)

    def process_weights_after_loading(self) -> None:
        """Packs 4-bit weights for the int4 kernel (filling the dense weight used for larger batches); for
        bfloat16 on a CPU with AMX also packs the dense weight for the tile kernel (batches of up to TILE_ROWS
        tokens); then reorders it for oneDNN's CPU matmul (larger batches), dropping the plain copy."""
        if self.q4 is not None:
            self.q4_weight = self.q4.finish(self.weight)
            self.q4 = None
        self.cpu_tiles = cpu_kernels.pack_tiles(self.weight) if self.use_tiles else None
        if self.cpu_tiles is not None:
            self.tile_bias = self.bias.float() if self.bias is not None else None
        self.cpu_weight = pack_for_cpu(self.weight)
        if self.cpu_weight is not None:
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if self.q4_weight is not None and rows <= MAX_ROWS:
            out = q4_matmul(x, *self.q4_weight)
            return out + self.bias if self.bias is not None else out
        if self.cpu_tiles is not None and rows <= TILE_ROWS:
            return cpu_kernels.linear_tiles(x, self.cpu_tiles, self.tile_bias)
        if self.cpu_weight is not None:
            return packed_linear(x, self.cpu_weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks."""


class RowParallelLinear(LinearBase):
    """Input features split across ranks (outputs summed)."""


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (e.g. gate and up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = output_sizes

    def _shard_range(self, shard_id: object) -> tuple[int, int]:
        index = int(shard_id)
        start = sum(self.output_sizes[:index])
        return start, self.output_sizes[index]


class QKVParallelLinear(MergedColumnParallelLinear):
    """Q, K and V projections in one matmul; shards named "q", "k", "v"."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, [self.q_size, self.kv_size, self.kv_size], bias)

    def _shard_range(self, shard_id: object) -> tuple[int, int]:
        return super()._shard_range({"q": 0, "k": 1, "v": 2}[shard_id])
