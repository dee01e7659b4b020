"""Linear layers named for tensor parallelism: column-parallel layers split their output rows across ranks,
row-parallel layers their input features (and sum their outputs over the ranks). The shard sizes and the group come
from the build context; with one rank each layer holds its whole weight.

A layer's weights and matmul belong to its `LinearMethod`, the quant_config's choice for the layer's dotted name
(`prefix`), dense when none. Each parameter carries `weight_loader(param, loaded, shard_id=None)`, which copies a
checkpoint tensor, or one projection of a merged layer (`shard_id`), into this rank's slice."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import cpu_kernels
from pagedllm.layers.build_context import current_build_context, divide
from pagedllm.layers.quantization.base import LinearMethod, LinearMethodVariant, QuantizationConfig
from pagedllm.layers.quantization.fp8_gemv import dense_gemv, dense_gemv_applies

# Batches of up to this many tokens take the AMX tile kernel (cpu_matmul.c): it reads the weights once per call and
# beat oneDNN's matmul at 1-64 rows (one call of each of SmolLM2's linears at 64 rows, weights in cache: 31/22/115/43
# us against 50/38/129/73), and lost to it from 128 rows up (25-35% slower at 2,560: prefill chunks stay on oneDNN).
# Both packings are kept.
TILE_ROWS = 64


def new_param(*shape: int, dtype: torch.dtype | None = None, **attrs: object) -> nn.Parameter:
    """An uninitialized parameter (dtype and device from the loading context unless given) with loader attributes
    (weight_loader, output_dim, input_dim)."""
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    for key, value in attrs.items():
        setattr(param, key, value)
    return param


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


class DenseLinearMethod(LinearMethod):
    """The weight as it is, [out_features, in_features] in the model dtype, through F.linear. After loading on a CPU
    it is packed for oneDNN and, in bfloat16 on a CPU with AMX, for the tile kernel (see `pack_dense`)."""

    def create_weights(self, layer: LinearBase, input_size: int, output_sizes: list[int]) -> None:
        layer.weight = new_param(
            sum(output_sizes), input_size, output_dim=0, input_dim=1, weight_loader=layer.weight_loader
        )

    def process_weights_after_loading(self, layer: LinearBase) -> LinearMethod:
        return pack_dense(layer)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


class OneDNNLinearMethod(LinearMethodVariant):
    """The dense weight reordered for oneDNN's CPU matmul (layer.cpu_weight)."""

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, layer.cpu_weight, layer.bias)


class TiledLinearMethod(LinearMethodVariant):
    """Batches of up to TILE_ROWS tokens on AMX tiles (layer.cpu_tiles, layer.tile_bias), larger ones by `large`."""

    def __init__(self, large: LinearMethod) -> None:
        self.large = large

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= TILE_ROWS * x.shape[-1]:  # rows <= TILE_ROWS (with no input features: no rows)
            return cpu_kernels.linear_tiles(x, layer.cpu_tiles, layer.tile_bias)
        return self.large.apply(layer, x)


class GemvLinearMethod(LinearMethodVariant):
    """The dense weight on a GPU: one-row batches of bfloat16/float16 (decode at batch 1) through the skinny Triton
    kernel (quantization/fp8_gemv.py: dense_gemv), which launches while the kernel before it finishes; the rest
    through F.linear (cuBLAS)."""

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if dense_gemv_applies(x2, layer.weight):
            return dense_gemv(x2, layer.weight, layer.bias).view(*x.shape[:-1], -1)
        return F.linear(x, layer.weight, layer.bias)


DENSE, ONEDNN, GEMV = DenseLinearMethod(), OneDNNLinearMethod(), GemvLinearMethod()


def pack_dense(layer: LinearBase) -> LinearMethod:
    """Packs the loaded dense weight for this machine and returns the method that applies it: for bfloat16 on a
    CPU with AMX the tile packing (batches of up to TILE_ROWS tokens), then oneDNN's order (larger batches; the
    plain copy is dropped), else the plain weight (GPU: GemvLinearMethod)."""
    if layer.weight.is_cuda:
        layer.cpu_tiles = layer.tile_bias = layer.cpu_weight = None
        return GEMV
    tiles = cpu_kernels.pack_tiles(layer.weight) if layer.use_tiles else None
    layer.cpu_tiles = tiles  # [packed bfloat16 tiles] or None
    layer.tile_bias = layer.bias.float() if tiles is not None and layer.bias is not None else None
    layer.cpu_weight = pack_for_cpu(layer.weight)
    large: LinearMethod = DENSE
    if layer.cpu_weight is not None:
        layer.weight = None
        large = ONEDNN
    return TiledLinearMethod(large) if tiles is not None else large


class LinearBase(nn.Module):
    """y = x @ W.T + b with W and the matmul owned by `quant_method`. Sizes: `input_size` and `output_sizes` are
    the whole layer's (one entry per merged projection); `*_per_partition` / `output_partition_sizes` this rank's."""

    use_tiles = True  # False where the layer's forward fuses its epilogue into oneDNN's matmul (tiles would be unused)

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        context = current_build_context()
        self.tp_rank, self.tp_size, self.tp_group = context.tp_rank, context.tp_size, context.tp_group
        self.prefix = prefix
        self.input_size, self.output_sizes, self.output_size = input_size, list(output_sizes), sum(output_sizes)
        self.input_size_per_partition = self.partition_input(input_size)
        self.output_partition_sizes = self.partition_outputs(self.output_sizes)
        self.output_size_per_partition = sum(self.output_partition_sizes)
        method = quant_config.get_linear_method(self, prefix) if quant_config is not None else None
        self.quant_method: LinearMethod = method if method is not None else DENSE
        self.quant_method.create_weights(self, self.input_size_per_partition, self.output_partition_sizes)
        self.bias = None
        if bias:  # [out_features of this rank]
            self.bias = new_param(self.output_size_per_partition, output_dim=0, weight_loader=self.weight_loader)

    def partition_input(self, input_size: int) -> int:
        return input_size

    def partition_outputs(self, output_sizes: list[int]) -> list[int]:
        return list(output_sizes)

    def output_shard(self, shard_id: object) -> tuple[int, int, int]:
        """(first row in this rank's parameter, rows, first row in the checkpoint tensor) of projection `shard_id`
        (None: the whole output) along a parameter's output dim."""
        return 0, self.output_size_per_partition, 0

    def rank_part(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object) -> torch.Tensor:
        """The part of checkpoint tensor `loaded` (anything with .narrow) that this rank holds."""
        if self.tp_size == 1:
            return loaded
        output_dim, input_dim = getattr(param, "output_dim", None), getattr(param, "input_dim", None)
        if output_dim is not None:
            _, size, source = self.output_shard(shard_id)
            loaded = loaded.narrow(output_dim, source, size)
        if input_dim is not None and self.input_size_per_partition != self.input_size:
            size = self.input_size_per_partition
            loaded = loaded.narrow(input_dim, self.tp_rank * size, size)
        return loaded

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        """Copies this rank's part of `loaded` into its rows of `param` (all of them when shard_id is None)."""
        target = param.data
        output_dim = getattr(param, "output_dim", None)
        if output_dim is not None and shard_id is not None:
            start, size, _ = self.output_shard(shard_id)
            target = target.narrow(output_dim, start, size)
        default_weight_loader(target, self.rank_part(param, loaded, shard_id))

    def process_weights_after_loading(self) -> None:
        self.quant_method = self.quant_method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)

    def takes_fp8_input(self, x: torch.Tensor) -> bool:
        """Whether the kernel making this layer's input x may hand it over quantized to fp8 per token (an
        fp8_ops.QuantizedActivations): the layer's method says so (FP8 with dynamic per-token activations; not
        LoRA's wrapper, which adds its term on the unquantized input)."""
        wants = getattr(self.quant_method, "takes_fp8_input", None)
        return wants is not None and wants(self, x)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, method={type(self.quant_method).__name__}"


class SingleLinear(LinearBase):
    """A linear layer of one projection (output_size rows)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(input_size, [output_size], bias, quant_config, prefix)


class ReplicatedLinear(SingleLinear):
    """The whole weight on every rank (small layers every rank needs whole, such as an MoE router)."""


class ColumnParallelLinear(SingleLinear):
    """Output rows split across ranks."""

    def partition_outputs(self, output_sizes: list[int]) -> list[int]:
        return [divide(size, self.tp_size, "output_size") for size in output_sizes]

    def output_shard(self, shard_id: object) -> tuple[int, int, int]:
        size = self.output_size_per_partition
        return 0, size, self.tp_rank * size


class RowParallelLinear(SingleLinear):
    """Input features split across ranks, their outputs summed over the ranks (one all-reduce). The bias is added
    once: the first rank holds it, the others zeros. reduce_results False (set by a model, models/llama.py:
    defer_reductions): the output is this rank's partial sum, and the layer after it sums it."""

    reduce_results = True

    def partition_input(self, input_size: int) -> int:
        return divide(input_size, self.tp_size, "input_size")

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        if param is self.bias and self.tp_rank > 0:
            param.data.zero_()
            return
        super().weight_loader(param, loaded, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, x)
        if self.tp_size > 1 and self.reduce_results:
            self.tp_group.all_reduce(out)
        return out


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel projections of the same input in one matmul (e.g. gate and up); shards 0, 1, ..."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(input_size, output_sizes, bias, quant_config, prefix)

    def partition_outputs(self, output_sizes: list[int]) -> list[int]:
        return [divide(size, self.tp_size, "output_size") for size in output_sizes]

    shard_ids: tuple = ()  # the projections' ids in output order (default: 0, 1, ...)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        """A checkpoint tensor holding all the projections fused (shard_id None) is cut into them first, each rank
        then taking its rows of each."""
        if shard_id is None and self.tp_size > 1 and getattr(param, "output_dim", None) is not None:
            dim, start = param.output_dim, 0
            for sid, size in zip(self.shard_ids or range(len(self.output_sizes)), self.output_sizes):
                super().weight_loader(param, loaded.narrow(dim, start, size), sid)
                start += size
            return
        super().weight_loader(param, loaded, shard_id)

    def output_shard(self, shard_id: object) -> tuple[int, int, int]:
        if shard_id is None:  # the projections stored fused in the checkpoint, taken whole (one rank)
            return 0, self.output_size_per_partition, 0
        index = int(shard_id)
        size = self.output_partition_sizes[index]
        return sum(self.output_partition_sizes[:index]), size, self.tp_rank * size


class MergedReplicatedLinear(MergedColumnParallelLinear):
    """Several projections of the same input in one matmul, whole on every rank (DeepSeek's q_a and kv_a)."""

    def partition_outputs(self, output_sizes: list[int]) -> list[int]:
        return list(output_sizes)

    def output_shard(self, shard_id: object) -> tuple[int, int, int]:
        if shard_id is None:
            return 0, self.output_size_per_partition, 0
        index = int(shard_id)
        return sum(self.output_sizes[:index]), self.output_sizes[index], 0

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        LinearBase.weight_loader(self, param, loaded, shard_id)


class QKVParallelLinear(MergedColumnParallelLinear):
    """Q, K and V projections in one matmul; shards "q", "k", "v". Heads split across ranks; with more ranks than
    KV heads each KV head is replicated on tp_size / num_kv_heads ranks."""

    shard_ids = ("q", "k", "v")

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        self.head_dim, self.total_num_heads, self.total_num_kv_heads = head_dim, num_heads, num_kv_heads
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, sizes, bias, quant_config, prefix)
        self.q_size, self.kv_size = self.output_partition_sizes[0], self.output_partition_sizes[1]  # this rank's

    def partition_outputs(self, output_sizes: list[int]) -> list[int]:
        self.num_heads = divide(self.total_num_heads, self.tp_size, "num_heads")
        if self.tp_size >= self.total_num_kv_heads:
            if self.tp_size % self.total_num_kv_heads:
                raise ValueError(
                    f"tensor-parallel size {self.tp_size} must be a multiple of num_kv_heads={self.total_num_kv_heads}"
                )
            self.num_kv_heads, self.kv_replicas = 1, self.tp_size // self.total_num_kv_heads
        else:
            self.num_kv_heads, self.kv_replicas = divide(self.total_num_kv_heads, self.tp_size, "num_kv_heads"), 1
        kv = self.num_kv_heads * self.head_dim
        return [self.num_heads * self.head_dim, kv, kv]

    def output_shard(self, shard_id: object) -> tuple[int, int, int]:
        if shard_id is None:
            return super().output_shard(None)
        index = {"q": 0, "k": 1, "v": 2}[shard_id]
        start, size, _ = super().output_shard(index)
        rank = self.tp_rank if index == 0 else self.tp_rank // self.kv_replicas
        return start, size, rank * size
