"""Weight-only integer quantization (W4A16 / W8A16): the linear-method family that GPTQ, AWQ and compressed-tensors'
pack-quantized checkpoints share. A format's method registers its checkpoint tensors and unpacks them after loading
into one form (q [K, N] unsigned values, zero points and scales [num_groups, N], each projection's groups of the
input features); from there one path for all:

- CUDA: the values repacked along K (int_packing's K-packed layout), float32 scales and zero points (none when every
  zero is the midpoint 2**(bits - 1)), the Triton GEMMs of wna16_gemm.py. Act-order groups (g_idx) become a
  permutation of the input features when the projections of the layer share one; otherwise the dense path.
- Elsewhere (CPU): the weight dequantized once to the compute dtype, then the dense method's packing."""

from __future__ import annotations

import functools
from abc import abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.layers.linear import LinearBase, default_weight_loader, new_param, pack_dense
from pagedllm.layers.quantization.base import LinearMethod, LinearMethodVariant
from pagedllm.layers.quantization.fp8 import checkpoint_names
from pagedllm.layers.quantization.fp8_ops import triton
from pagedllm.layers.quantization.int_packing import dequantize, groups_of, pack_factor, pack_int32, sort_groups
from pagedllm.layers.quantization.wna16_gemm import wna16_linear

SHARD_INDEX = {"q": 0, "k": 1, "v": 2}


def kernel_device(device: torch.device) -> bool:
    """Whether layers on `device` keep their weights packed for the Triton GEMMs (else: dequantized, dense)."""
    return device.type == "cuda" and triton is not None


@dataclass
class Unpacked:
    """A layer's weight as its format stores it, unpacked: q [K, N] (unsigned ints), zeros [num_groups, N] (None:
    the midpoint), scales [num_groups, N] float32, g_idx [num_projections, K] (None: feature k in group k // size)."""

    q: torch.Tensor
    zeros: torch.Tensor | None
    scales: torch.Tensor
    g_idx: torch.Tensor | None


def load_part(
    layer: LinearBase, pack: int, unit: int | None, param: torch.Tensor, loaded: torch.Tensor, shard_id=None
) -> None:
    """A checkpoint tensor into its projection's part of `param` along `param.output_dim` (None: the whole param),
    that dim holding `pack` outputs per element (packed zero points / weights), 1 otherwise. With tensor parallelism
    this rank's part: its outputs (column-parallel), or its input features along the other dim (row-parallel), which
    holds `unit` input features per element (1, the K-packing factor, or the group size; None: not split)."""
    target, dim = param.data, param.output_dim
    if shard_id is not None or layer.tp_size > 1:
        start, size, source = layer.output_shard(shard_id)
        if start % pack or source % pack or (layer.tp_size > 1 and size % pack):
            raise ValueError(
                f"{layer.prefix}: projection {shard_id!r} of this tensor-parallel rank (outputs {source} to "
                f"{source + size}) does not start and end on a packed word of {pack} outputs"
            )
        target = target.narrow(dim, start // pack, -(-size // pack))
        if layer.tp_size > 1:
            loaded = loaded.narrow(dim, source // pack, -(-size // pack))
    kp = layer.input_size_per_partition
    if kp != layer.input_size and unit is not None:  # row-parallel: this rank's input features (checked divisible)
        loaded = loaded.narrow(1 - dim, layer.tp_rank * kp // unit, kp // unit)
    default_weight_loader(target, loaded)


def load_per_projection(layer: LinearBase, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    """A per-projection tensor (g_idx [K], weight_shape [2]) into its row of param [num_projections, ...]; a
    checkpoint tensor of the whole (fused) layer fills every row."""
    if shard_id is None:
        for row in param.data:
            default_weight_loader(row, loaded)
        return
    default_weight_loader(param.data[SHARD_INDEX.get(shard_id, shard_id)], loaded)


def load_g_idx(layer: LinearBase, group_size: int, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    """g_idx [K]; a row-parallel rank takes its features and numbers their groups from its first group."""
    kp = layer.input_size_per_partition
    if kp != layer.input_size:
        first = layer.tp_rank * kp
        loaded = loaded.narrow(0, first, kp) - (first // group_size if group_size != -1 else 0)
        groups = 1 if group_size == -1 else kp // group_size
        if len(loaded) and (int(loaded.min()) < 0 or int(loaded.max()) >= groups):
            raise ValueError(
                f"{layer.prefix}: act-order groups (g_idx) mix input features of several tensor-parallel ranks; "
                "such a checkpoint runs with tensor_parallel_size=1 (or without desc_act / actorder)"
            )
    load_per_projection(layer, param, loaded, shard_id)


class WNA16LinearMethod(LinearMethod):
    """Integer weights of `bits` bits with a scale (and zero point) per `group_size` input features (-1: one group,
    channel-wise). Subclasses name the checkpoint's tensors (`create_format_weights`) and unpack them (`unpack`)."""

    def __init__(self, bits: int, group_size: int) -> None:
        self.bits, self.group_size = bits, group_size

    def num_groups(self, input_size: int) -> int:
        return 1 if self.group_size == -1 else -(-input_size // self.group_size)

    def param(self, layer: LinearBase, *shape: int, dtype: torch.dtype, output_dim: int, pack: int = 1, unit="group"):
        """A 2-D checkpoint tensor's parameter whose `output_dim` holds `pack` outputs per element and whose other dim
        `unit` input features per element ("group": one group each; a row-parallel rank takes its part of it)."""
        if unit == "group":
            unit = None if self.group_size == -1 else self.group_size
        loader = functools.partial(load_part, layer, pack, unit)
        return new_param(*shape, dtype=dtype, output_dim=output_dim, weight_loader=loader)

    def g_idx_param(self, layer: LinearBase, k: int) -> nn.Parameter:
        """g_idx [num_projections, K] (int32): each input feature's group."""
        param = self.per_projection(layer, k, dtype=torch.int32, dummy=self.dummy_groups)
        param.weight_loader = functools.partial(load_g_idx, layer, self.group_size)
        return param

    def per_projection(self, layer: LinearBase, *shape: int, dtype: torch.dtype, dummy) -> nn.Parameter:
        """[num_projections, *shape]; `dummy(tensor)` fills it for load_format="dummy"."""
        loader = functools.partial(load_per_projection, layer)
        return new_param(len(layer.output_partition_sizes), *shape, dtype=dtype, weight_loader=loader, dummy_fill=dummy)

    def create_weights(self, layer: LinearBase, input_size: int, output_sizes: list[int]) -> None:
        layer.wna16_compute_dtype = torch.get_default_dtype()
        if input_size != layer.input_size:  # row-parallel: groups and packed words must not straddle two ranks
            pack = pack_factor(self.bits)
            for what, unit in (("group_size", self.group_size), (f"{self.bits}-bit packing of", pack)):
                if unit != -1 and input_size % unit:
                    raise ValueError(
                        f"{layer.prefix}: {what} {unit} input features does not divide the {input_size} input "
                        f"features of each tensor-parallel rank (input_size {layer.input_size} / tensor_parallel_size "
                        f"{layer.tp_size}); use a tensor_parallel_size that does"
                    )
        self.create_format_weights(layer, input_size, sum(output_sizes))

    @abstractmethod
    def create_format_weights(self, layer: LinearBase, k: int, n: int) -> None:
        """Registers the checkpoint's tensors of a [K -> N] layer on it."""

    @abstractmethod
    def unpack(self, layer: LinearBase) -> Unpacked:
        """The loaded tensors unpacked (and removed from the layer)."""

    def dummy_groups(self, g_idx: torch.Tensor) -> None:
        """g_idx without act order: feature k in group k // group_size."""
        k = g_idx.shape[-1]
        size = k if self.group_size == -1 else self.group_size
        g_idx.copy_((torch.arange(k, device=g_idx.device) // size).expand_as(g_idx))

    def process_weights_after_loading(self, layer: LinearBase) -> LinearMethod:
        u = self.unpack(layer)
        k, n = u.q.shape
        group_size = k if self.group_size == -1 else self.group_size
        if u.zeros is not None and bool((u.zeros == 1 << (self.bits - 1)).all()):
            u.zeros = None  # symmetric after all: the kernel's constant midpoint
        if u.g_idx is not None:
            u.g_idx = u.g_idx.long()
            if int(u.g_idx.min()) < 0 or int(u.g_idx.max()) >= u.scales.shape[0]:
                raise ValueError(f"{layer.prefix}: g_idx names groups outside 0..{u.scales.shape[0] - 1}")
        perm = self.kernel_permutation(u, group_size)
        if kernel_device(u.q.device) and perm is not False:
            if perm is not None:
                u.q = u.q[perm]
            layer.wq_packed = nn.Parameter(pack_int32(u.q, self.bits, dim=0), requires_grad=False)  # [K/pack, N]
            layer.wq_scales = nn.Parameter(u.scales.float().contiguous(), requires_grad=False)  # [groups, N]
            zeros = u.zeros.float().contiguous() if u.zeros is not None else None
            layer.wq_zeros = nn.Parameter(zeros, requires_grad=False) if zeros is not None else None  # [groups, N]
            layer.wq_perm = perm.to(torch.int32) if perm is not None else None  # [K] or None (int32: kernel offsets)
            return WNA16GemmMethod(self.bits, group_size)
        layer.weight = nn.Parameter(self.dense_weight(layer, u, group_size), requires_grad=False)
        return pack_dense(layer)

    @staticmethod
    def kernel_permutation(u: Unpacked, group_size: int) -> torch.Tensor | None | bool:
        """The input-feature permutation the kernel path needs: None (groups in order), a permutation (act order,
        shared by every projection), or False (no single one: the dense path)."""
        if u.g_idx is None:
            return None
        first = u.g_idx[0]
        if not bool((u.g_idx == first).all()):
            return False
        if torch.equal(first, torch.arange(first.numel(), device=first.device) // group_size):
            return None
        perm = sort_groups(first, group_size)
        return False if perm is None else perm

    def dense_weight(self, layer: LinearBase, u: Unpacked, group_size: int) -> torch.Tensor:
        """The dequantized weight [N, K] in the compute dtype (each projection with its own groups)."""
        k, n = u.q.shape
        dtype = layer.wna16_compute_dtype
        zeros = u.zeros if u.zeros is not None else torch.full_like(u.scales, float(1 << (self.bits - 1)))
        if u.g_idx is None:
            return dequantize(u.q, zeros, u.scales, groups_of(None, k, group_size, u.q.device), dtype)
        parts, start = [], 0
        for size, g_idx in zip(layer.output_partition_sizes, u.g_idx):
            cols = slice(start, start + size)
            parts.append(dequantize(u.q[:, cols], zeros[:, cols], u.scales[:, cols], g_idx, dtype))
            start += size
        return torch.cat(parts, dim=0)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{layer.prefix}: integer weights run after process_weights_after_loading")


class WNA16GemmMethod(LinearMethodVariant):
    """CUDA: the K-packed weight (layer.wq_packed, wq_scales, wq_zeros, wq_perm) through the Triton GEMMs."""

    def __init__(self, bits: int, group_size: int) -> None:
        self.bits, self.group_size = bits, group_size

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        return wna16_linear(
            x, layer.wq_packed, layer.wq_scales, layer.wq_zeros, layer.bias, layer.wq_perm, self.bits, self.group_size
        )


def take(layer: LinearBase, *names: str) -> list[torch.Tensor]:
    """The loaded tensors `names`, removed from the layer."""
    out = [getattr(layer, name).data for name in names]
    for name in names:
        delattr(layer, name)
    return out


def check_bits(bits: object, supported: tuple[int, ...], fmt: str, field: str = "bits") -> int:
    if type(bits) is not int or bits not in supported:
        raise ValueError(f"{fmt}: quantization_config.{field}={bits!r} is not supported (supported: {list(supported)})")
    return bits


def check_group_size(group_size: object, fmt: str, field: str = "group_size") -> int:
    if type(group_size) is not int or not (group_size == -1 or group_size > 0):
        raise ValueError(
            f"{fmt}: quantization_config.{field}={group_size!r} is not supported (supported: a positive number of "
            "input features per scale, or -1: one scale per output channel)"
        )
    return group_size


def not_converted(prefix: str, modules: list[str]) -> bool:
    """Whether `modules_to_not_convert` (substrings of module names, as AutoAWQ / optimum match them) names a
    projection of layer `prefix`."""
    return any(module in name for name in checkpoint_names(prefix) for module in modules)
