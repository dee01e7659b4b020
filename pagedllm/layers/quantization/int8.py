"""INT8 W8A8 linear layers (compressed-tensors' "int-quantized" W8A8 schemes, as llm-compressor writes them):
int8 weights [N, K] with a scale per output channel (or per projection), activations quantized to int8 per token on
the fly (scale = amax(|row|) / 127, round half to even, clamp to [-128, 127], as vLLM's kernels do) or with a static
per-tensor input_scale.

On CUDA the weights stay int8 and each matmul is torch._int_mm (cuBLASLt's int8 GEMM, int32 sums) scaled by the
token and channel scales. Elsewhere (CPU, where torch's int8 matmul measured slower than the float one) the weight is
dequantized to the compute dtype once, at load, and the activations are rounded to their int8 values before the
dense matmul: the same numbers the int8 GEMM computes with."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.linear import LinearBase, new_param, pack_dense
from pagedllm.layers.quantization.base import LinearMethod, LinearMethodVariant
from pagedllm.layers.quantization.fp8 import load_row_scale, load_scalar_scale

INT8_MAX = 127.0
MIN_SCALE = 1e-10  # an all-zero row still gets a finite scale
INT_MM_MIN_ROWS = 17  # torch._int_mm on CUDA takes more than 16 rows: smaller batches are zero-padded
INT_MM_ALIGN = 8  # and K, N divisible by 8


def quantize_int8(x2: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 [M, K] -> (q [M, K] int8, scale [M, 1] float32) with x2 ~= q * scale: per token, or the static scale."""
    xf = x2.float()
    if input_scale is not None:
        scale = input_scale.float().reshape(1, 1).expand(x2.shape[0], 1)
    else:
        scale = (xf.abs().amax(dim=-1, keepdim=True) / INT8_MAX).clamp_min(MIN_SCALE)
    return torch.round(xf / scale).clamp(-128, 127).to(torch.int8), scale.contiguous()


def int8_linear(x, weight, weight_scale, input_scale, bias) -> torch.Tensor:
    """x [..., K] @ (weight [N, K] int8 * weight_scale [N]).T + bias -> [..., N] in x's dtype, through the int8
    GEMM (torch._int_mm) with the activations quantized per token (or with the static input_scale)."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)  # [M, K]
    m = x2.shape[0]
    qx, sx = quantize_int8(x2, input_scale)
    if m < INT_MM_MIN_ROWS:
        qx = F.pad(qx, (0, 0, 0, INT_MM_MIN_ROWS - m))  # [17, K]
    acc = torch._int_mm(qx, weight.t())[:m]  # [M, N] int32
    out = (acc.float() * sx * weight_scale[None, :]).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], n)


def fake_quantize_int8(x: torch.Tensor, input_scale: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] rounded to what its int8 quantization represents, in x's dtype."""
    q, scale = quantize_int8(x.reshape(-1, x.shape[-1]), input_scale)
    return (q.float() * scale).to(x.dtype).reshape(x.shape)


class Int8LinearMethod(LinearMethod):
    """weight int8 [N, K]; `weight_scale` [N] ("channel") or [num_projections] ("tensor"); static activations take
    `input_scale` [num_projections] (q, k and v share their input: the largest one is used, as vLLM does)."""

    def __init__(self, weight_strategy: str, static: bool) -> None:
        self.weight_strategy, self.static = weight_strategy, static

    def create_weights(self, layer: LinearBase, input_size: int, output_sizes: list[int]) -> None:
        layer.int8_compute_dtype = torch.get_default_dtype()
        rows, shards = sum(output_sizes), len(output_sizes)
        layer.weight = new_param(
            rows, input_size, dtype=torch.int8, output_dim=0, input_dim=1, weight_loader=layer.weight_loader
        )
        scalar = functools.partial(load_scalar_scale, layer)
        if self.weight_strategy == "channel":  # [N]
            row = functools.partial(load_row_scale, layer)
            layer.weight_scale = new_param(rows, dtype=torch.float32, output_dim=0, weight_loader=row)
        else:  # [num_projections]
            layer.weight_scale = new_param(shards, dtype=torch.float32, weight_loader=scalar)
        if self.static:  # [num_projections]
            layer.input_scale = new_param(shards, dtype=torch.float32, weight_loader=scalar)

    def process_weights_after_loading(self, layer: LinearBase) -> LinearMethod:
        scale = layer.weight_scale.data.float()
        if self.weight_strategy == "tensor":
            sizes = torch.tensor(layer.output_partition_sizes, device=scale.device)
            scale = scale.repeat_interleave(sizes)  # [N]
        input_scale = layer.input_scale.data.float().max() if self.static else None
        if self.static:
            del layer.input_scale
        layer.input_scale = input_scale  # float32 scalar, or None
        weight = layer.weight.data
        n, k = weight.shape
        if weight.device.type == "cuda" and k % INT_MM_ALIGN == 0 and n % INT_MM_ALIGN == 0:
            layer.weight = nn.Parameter(weight.contiguous(), requires_grad=False)  # [N, K] int8
            layer.weight_scale = nn.Parameter(scale.contiguous(), requires_grad=False)  # [N] float32
            return Int8GemmMethod()
        del layer.weight_scale
        dense = (weight.float() * scale[:, None]).to(layer.int8_compute_dtype)  # [N, K]
        layer.weight = nn.Parameter(dense, requires_grad=False)
        return Int8EmulatedMethod(pack_dense(layer))

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{layer.prefix}: int8 weights run after process_weights_after_loading")


class Int8GemmMethod(LinearMethodVariant):
    """CUDA: activations quantized to int8, then torch._int_mm."""

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, layer.weight, layer.weight_scale, layer.input_scale, layer.bias)


class Int8EmulatedMethod(LinearMethodVariant):
    """The activations rounded to their int8 values, then `dense` (the dequantized weight's dense packing)."""

    def __init__(self, dense: LinearMethod) -> None:
        self.dense = dense

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        return self.dense.apply(layer, fake_quantize_int8(x, layer.input_scale))
