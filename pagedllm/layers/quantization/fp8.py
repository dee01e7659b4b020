"""FP8 (e4m3) linear layers: checkpoints with `quant_method: "fp8"` (per-tensor `weight_scale` with static
`input_scale` or dynamic activation scales, or `weight_block_size` blocks), the FP8 schemes of compressed-tensors
(compressed_tensors.py) and `quantization="fp8"` of a float checkpoint (weights quantized per output channel at load,
activations per token on the fly).

On CUDA the weights stay fp8 and each matmul runs through the scaled FP8 GEMM with the activations quantized first
(fp8_ops.fp8_matmul; batches of up to 16 rows: the skinny Triton GEMM of fp8_gemv.py, which quantizes one-row
activations itself; the batch sizes fp8_gemm.TABLE holds: its Triton GEMM; block-wise weights: the Triton GEMM of
fp8_block.py). Activations a norm or SiLU-and-mul quantized already come as fp8_ops.QuantizedActivations.
Elsewhere the fp8 weights are dequantized to the compute dtype once, at load, and take the dense path, with the
activations rounded to their fp8 values first: the same numbers the GEMM computes with (and that transformers
computes with on a compressed-tensors checkpoint)."""

from __future__ import annotations

import functools
import re
from typing import Any

import torch
from torch import nn

from pagedllm.layers.linear import DENSE, LinearBase, new_param, pack_dense
from pagedllm.layers.quantization.base import LinearMethod, LinearMethodVariant, QuantizationConfig
from pagedllm.layers.quantization.fp8_block import block_fp8_linear, block_gemm_supported
from pagedllm.layers.quantization.fp8_gemm import fp8_rowwise_mm, gemm_applies
from pagedllm.layers.quantization.fp8_gemv import FUSE_MAX_M, fp8_gemv, fp8_gemv_fused, gemv_applies
from pagedllm.layers.quantization.fp8_ops import (
    FP8_DTYPE,
    QuantizedActivations,
    dequantize_weight,
    fake_quantize_activations,
    fp8_matmul,
    quantize_activations,
    quantize_weight_per_channel,
)

WEIGHT_STRATEGIES = ("tensor", "channel", "block")  # a weight scale per projection / output row / [bn, bk] block
# per token | one from the checkpoint | one per batch | per token and group of block[1] features | not quantized
ACTIVATION_SCHEMES = ("dynamic", "static", "dynamic-tensor", "dynamic-group", None)
MERGED_NAMES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
SHARD_INDEX = {"q": 0, "k": 1, "v": 2}
# CUDA, activations quantized per token on the fly: the RMSNorm or SiLU-and-mul before the layer writes them as fp8
# with their scales in its own kernel (Fp8ScaledMMMethod.takes_fp8_input), not a quantization launch of their own
FUSE_INPUT_QUANT = True


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


def load_block_scale(
    layer: LinearBase, block: tuple[int, int], param: torch.Tensor, loaded: torch.Tensor, shard_id=None
):
    """A block-wise scale [ceil(rows / bn), ceil(K / bk)] into its projection's block rows; with tensor parallelism
    this rank's block rows (column-parallel) or block columns (row-parallel), which must start on a block edge."""
    bn, bk = block
    if shard_id is not None or layer.tp_size > 1:
        start, size, source = layer.output_shard(shard_id)
    else:
        start, size, source = 0, param.shape[0] * bn, 0
    if layer.tp_size > 1:
        if source % bn:
            raise ValueError(
                f"{layer.prefix}: tensor-parallel rank {layer.tp_rank} starts at output row {source}, inside an fp8 "
                f"weight block of {bn} rows: block-wise FP8 needs each rank's rows to start on a block edge"
            )
        loaded = loaded.narrow(0, source // bn, min(-(-size // bn), loaded.shape[0] - source // bn))
        kp = layer.input_size_per_partition
        if kp != layer.input_size:
            if kp % bk:
                raise ValueError(
                    f"{layer.prefix}: the {kp} input features of a tensor-parallel shard (input_size "
                    f"{layer.input_size} / {layer.tp_size}) split fp8 weight blocks of {bk} columns"
                )
            loaded = loaded.narrow(1, layer.tp_rank * kp // bk, kp // bk)
    target = param.data.narrow(0, start // bn, min(-(-size // bn), param.shape[0] - start // bn))
    if target.shape != loaded.shape:
        raise ValueError(
            f"{layer.prefix}: block scale of shape {tuple(loaded.shape)} does not fit {tuple(target.shape)}"
        )
    target.copy_(loaded)


class Fp8LinearMethod(LinearMethod):
    """Weights fp8 [N, K] with their scale per projection ("tensor": `weight_scale` [num_projections]), per row
    ("channel": `weight_scale` [N]) or per block ("block": `scale_name` [ceil(N / bn), ceil(K / bk)]); static
    activations take `input_scale` [num_projections]. Of a float checkpoint (`serialized=False`) the weight loads in
    the compute dtype and is quantized per row after loading."""

    def __init__(
        self,
        weight_strategy: str = "tensor",
        activations: str | None = "dynamic",
        serialized: bool = True,
        block: tuple[int, int] | None = None,
        scale_name: str = "weight_scale",
    ) -> None:
        if weight_strategy not in WEIGHT_STRATEGIES:
            raise ValueError(f"fp8 weight strategy {weight_strategy!r} must be one of {WEIGHT_STRATEGIES}")
        if activations not in ACTIVATION_SCHEMES:
            raise ValueError(f"fp8 activation scheme {activations!r} must be one of {ACTIVATION_SCHEMES}")
        if (weight_strategy == "block") != (block is not None) or (activations == "dynamic-group") != (
            block is not None
        ):
            raise ValueError("block-wise fp8 weights take a block shape and dynamic per-group activations")
        self.weight_strategy, self.activations, self.serialized = weight_strategy, activations, serialized
        self.block, self.scale_name = block, scale_name

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
        elif self.weight_strategy == "channel":  # [N]
            row = functools.partial(load_row_scale, layer)
            layer.weight_scale = new_param(rows, dtype=torch.float32, output_dim=0, weight_loader=row)
        else:  # [ceil(N / bn), ceil(K / bk)]
            bn, bk = self.block
            if len(output_sizes) > 1 and any(size % bn for size in output_sizes):
                raise ValueError(f"{layer.prefix}: merged projections of {output_sizes} rows split fp8 blocks of {bn}")
            block_loader = functools.partial(load_block_scale, layer, self.block)
            scale = new_param(-(-rows // bn), -(-input_size // bk), dtype=torch.float32, weight_loader=block_loader)
            setattr(layer, self.scale_name, scale)
        if self.activations == "static":  # [num_projections]
            layer.input_scale = new_param(shards, dtype=torch.float32, weight_loader=scalar)

    def loaded_fp8(self, layer: LinearBase) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight fp8 [N, K], scale float32: [N], or [N, K] for blocks) from what loading put on the layer."""
        if not self.serialized:
            return quantize_weight_per_channel(layer.weight.data)
        scale = getattr(layer, self.scale_name).data.float()
        delattr(layer, self.scale_name)
        if self.weight_strategy == "tensor":
            sizes = torch.tensor(layer.output_partition_sizes, device=scale.device)
            scale = scale.repeat_interleave(sizes)  # [N]
        elif self.weight_strategy == "block":
            n, k = layer.weight.shape
            scale = scale.repeat_interleave(self.block[0], 0)[:n].repeat_interleave(self.block[1], 1)[:, :k]
        return layer.weight.data, scale

    def process_weights_after_loading(self, layer: LinearBase) -> LinearMethod:
        if self.block is not None and block_gemm_supported(layer.weight.device, self.block):
            scale = getattr(layer, self.scale_name).data.float().contiguous()  # [ceil(N / bn), ceil(K / bk)]
            delattr(layer, self.scale_name)
            layer.weight = nn.Parameter(layer.weight.data.contiguous(), requires_grad=False)  # [N, K] fp8
            layer.weight_scale = nn.Parameter(scale, requires_grad=False)
            return Fp8BlockGemmMethod(self.block)
        weight, scale = self.loaded_fp8(layer)
        input_scale = None
        if self.activations == "static":  # q, k and v (gate and up) share their input: one scale, the largest
            input_scale = layer.input_scale.data.float().max()
            del layer.input_scale
        layer.input_scale = input_scale  # float32 scalar, or None
        per_tensor_dynamic = self.activations == "dynamic-tensor"
        if weight.device.type == "cuda" and self.activations in ("dynamic", "static", "dynamic-tensor"):
            layer.weight = nn.Parameter(weight.contiguous(), requires_grad=False)  # [N, K] fp8
            layer.weight_scale = nn.Parameter(scale.contiguous(), requires_grad=False)  # [N] float32
            return Fp8ScaledMMMethod(per_tensor_dynamic)
        # the weight dequantized once, for the dense path (CPU; on CUDA: weight-only schemes, blocks the GEMM refuses)
        layer.weight = nn.Parameter(dequantize_weight(weight, scale, layer.fp8_compute_dtype), requires_grad=False)
        dense = pack_dense(layer)
        if self.activations is None:
            return dense
        group = self.block[1] if self.block is not None else None
        return Fp8EmulatedMethod(dense, per_tensor_dynamic, group)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{layer.prefix}: fp8 weights run after process_weights_after_loading (the loader calls it)")


class Fp8ScaledMMMethod(LinearMethodVariant):
    """CUDA: activations quantized to fp8 (per token, or the static / per-batch scale), then the scaled FP8 GEMM, or
    the skinny Triton GEMM (quantizing in the same launch) for batches of up to GEMV_MAX_M rows."""

    def __init__(self, per_tensor_dynamic: bool = False) -> None:
        self.per_tensor_dynamic = per_tensor_dynamic

    def takes_fp8_input(self, layer: LinearBase, x: torch.Tensor) -> bool:
        """Whether the kernel making x [M, K] may hand it over quantized (a QuantizedActivations): the activations
        are quantized per token on the fly, and the batch does not take the GEMV that quantizes inside itself."""
        if layer.input_scale is not None or self.per_tensor_dynamic or not FUSE_INPUT_QUANT:
            return False
        return x.dim() == 2 and x.shape[0] > FUSE_MAX_M

    def apply(self, layer: LinearBase, x: torch.Tensor | QuantizedActivations) -> torch.Tensor:
        if isinstance(x, QuantizedActivations):  # quantized per token by the kernel that made it
            return self.apply_quantized(layer, x)
        n, k = layer.weight.shape
        x2 = x.reshape(-1, k)  # [M, K]
        if gemv_applies(x2, layer.weight) and x2.shape[0] <= FUSE_MAX_M and not self.per_tensor_dynamic:
            out = fp8_gemv_fused(x2, layer.weight, layer.weight_scale, layer.input_scale, layer.bias)  # quantizes too
        else:
            xq, xs = quantize_activations(x2, layer.input_scale, self.per_tensor_dynamic)  # [M, K] fp8, [M, 1]
            out = self.apply_quantized(layer, QuantizedActivations(xq, xs, x.dtype))
        return out.reshape(*x.shape[:-1], n)

    @staticmethod
    def apply_quantized(layer: LinearBase, x: QuantizedActivations) -> torch.Tensor:
        """[M, N] from fp8 rows: decode-sized batches on the bandwidth-bound skinny kernel, mid-sized ones on the
        Triton GEMM where it measured faster, the rest on cuBLASLt's (or the dequantized matmul)."""
        if gemv_applies(x.q, layer.weight):
            return fp8_gemv(x.q, x.scale, layer.weight, layer.weight_scale.float(), layer.bias, x.dtype)
        if gemm_applies(x.q, layer.weight):
            out = fp8_rowwise_mm(x.q, x.scale, layer.weight, layer.weight_scale, x.dtype)
            return out if layer.bias is None else out.add_(layer.bias)
        return fp8_matmul(x.q, x.scale, layer.weight, layer.weight_scale, layer.bias, x.dtype)


class Fp8BlockGemmMethod(LinearMethodVariant):
    """CUDA, block-wise weights: activations quantized per token and group, the Triton block-scaled FP8 GEMM."""

    def __init__(self, block: tuple[int, int]) -> None:
        self.block = block

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        return block_fp8_linear(x, layer.weight, layer.weight_scale, self.block, layer.bias)


class Fp8EmulatedMethod(LinearMethodVariant):
    """The activations rounded to their fp8 values (as the FP8 GEMM would see them; per token, static, per batch or
    per group of `group` input features), then `dense` (the dequantized weight's dense packing)."""

    def __init__(self, dense: LinearMethod, per_tensor_dynamic: bool = False, group: int | None = None) -> None:
        self.dense, self.per_tensor_dynamic, self.group = dense, per_tensor_dynamic, group

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        x = fake_quantize_activations(x, layer.input_scale, self.per_tensor_dynamic, self.group)
        return self.dense.apply(layer, x)


def check_block(block: Any, field: str) -> tuple[int, int]:
    """A block shape [rows, cols] of positive ints, or a ValueError naming `field`."""
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise ValueError(f"quantization_config.{field}={block!r} must be two positive integers [rows, cols]")
    return int(block[0]), int(block[1])


class Fp8Config(QuantizationConfig):
    """quant_method "fp8": every linear layer fp8 except `ignored_layers` (checkpoint module names). Per-tensor
    `weight_scale`s, or with `weight_block_size` [bn, bk] a `weight_scale_inv` per block (multiplied, despite its
    name) and activations quantized per token and group of bk features."""

    name = "fp8"

    def __init__(
        self,
        activation_scheme: str = "dynamic",
        serialized: bool = True,
        ignored: list[str] | None = None,
        block: tuple[int, int] | None = None,
    ) -> None:
        if activation_scheme not in ("dynamic", "static"):
            raise ValueError(
                f"quantization_config.activation_scheme={activation_scheme!r} must be 'dynamic' or 'static'"
            )
        if not serialized and activation_scheme == "static":
            raise ValueError("quantization='fp8' of a float checkpoint takes dynamic activation scales only")
        if block is not None and activation_scheme != "dynamic":
            raise ValueError(
                f"quantization_config.activation_scheme={activation_scheme!r}: block-wise FP8 takes 'dynamic'"
            )
        self.ignored = list(ignored or [])
        if block is not None:
            self.method = Fp8LinearMethod("block", "dynamic-group", True, block, scale_name="weight_scale_inv")
        else:
            self.method = Fp8LinearMethod("tensor" if serialized else "channel", activation_scheme, serialized)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Config:
        block = config.get("weight_block_size")
        block = check_block(block, "weight_block_size") if block is not None else None
        ignored = config.get("ignored_layers") or config.get("modules_to_not_convert") or []
        return cls(config.get("activation_scheme", "dynamic"), serialized=True, ignored=ignored, block=block)

    @classmethod
    def dynamic(cls) -> Fp8Config:
        """`quantization="fp8"` of a float checkpoint: per-channel fp8 weights, per-token dynamic activations."""
        return cls("dynamic", serialized=False)

    def get_linear_method(self, layer: LinearBase, prefix: str) -> LinearMethod | None:
        if self.ignored and layer_matches(prefix, self.ignored, "ignored_layers"):
            return None
        return self.method
