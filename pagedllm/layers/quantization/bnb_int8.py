"""bitsandbytes 8-bit (LLM.int8) linear layers: weight int8 [N, K] with SCB float32 [N] (each row's absmax), w =
weight * SCB / 127.

bitsandbytes computes x @ w.T as: x cast to float16; the columns (input features) where any row of the batch has
|x| >= llm_int8_threshold are outliers, computed in the input's precision against the dequantized weight columns;
the rest is quantized per row (scale = absmax / 127 of the row without its outliers, round half to even) and
multiplied by the int8 weight. Here the input is rewritten into the numbers that computation uses (its int8 values
times their scale, the outlier columns as they are; plain torch ops, no host sync, so CUDA graphs capture it), then
one matmul with the weight gives the same products:
- CUDA (with Triton): the int8 weight stays 8-bit, offset to unsigned (q + 128, the W8A16 kernel's midpoint) in the
  K-packed int32 layout with one scale per output channel (SCB / 127), through wna16_gemm.py's Triton GEMMs.
- Elsewhere (CPU): the weight dequantized once at load to the compute dtype, then the dense method's packing.
As in bitsandbytes, which columns are outliers depends on the batch the row runs in."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagedllm.layers.linear import LinearBase, new_param, pack_dense
from pagedllm.layers.quantization.base import LinearMethod, LinearMethodVariant
from pagedllm.layers.quantization.int_packing import pack_int32
from pagedllm.layers.quantization.wna16 import kernel_device
from pagedllm.layers.quantization.wna16_gemm import wna16_linear

ROW_FORMAT = 0  # bitsandbytes' LINEAR_8BIT_WEIGHTS_FORMAT_MAPPING["row"]
MIN_ROW_SCALE = 1e-30  # an all-zero row quantizes to zeros (bitsandbytes would divide by 0)
# bitsandbytes' constants: a weight row's dequantization (int8_vectorwise_dequant, ~1 / 127) and the int8 GEMM's
# (int8_mm_dequant, written 6.200124e-05: 1.8e-5 relatively above 1 / 127**2); the int8 part of the input is scaled by
# their ratio so that against the dequantized weight it gives the GEMM's numbers
WEIGHT_DEQUANT = 7.874015718698502e-3
GEMM_DEQUANT = 6.200124e-05


def llm_int8_input(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """x [M, K] -> [M, K] (x's dtype): what LLM.int8's matmul multiplies the dequantized weight with."""
    half = x.to(torch.float16)
    outlier_cols = None
    if threshold > 0:
        outliers = half.abs() >= threshold  # [M, K]
        outlier_cols = outliers.any(dim=0)  # [K]
        half = half.masked_fill(outliers, 0)
    row_stats = half.abs().amax(dim=1).float().clamp_min(MIN_ROW_SCALE)[:, None]  # [M, 1]
    q = torch.round(half * (127.0 / row_stats))  # float32 int8 values
    out = q * (row_stats * (GEMM_DEQUANT / WEIGHT_DEQUANT))
    if outlier_cols is not None:
        out = torch.where(outlier_cols[None, :], x.float(), out)
    return out.to(x.dtype)


def load_int8(layer: LinearBase, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    if loaded.dtype != torch.int8:
        raise ValueError(
            f"{layer.prefix}: a bitsandbytes 8-bit layer got a weight of dtype {loaded.dtype} (is this projection "
            "stored unquantized? then name it in llm_int8_skip_modules)"
        )
    layer.weight_loader(param, loaded, shard_id)


def drop_weight_format(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors without "<module>.weight_format" (checked: row-major, the only layout read here)."""
    for name, tensor in weights:
        if name.endswith(".weight_format"):
            if tensor.numel() != 1 or int(tensor.reshape(-1)[0]) != ROW_FORMAT:
                raise ValueError(f"{name}={tensor.tolist()} is not supported (supported: {ROW_FORMAT}, row-major)")
            continue
        yield name, tensor


class Int8WeightMethod(LinearMethod):
    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def create_weights(self, layer: LinearBase, input_size: int, output_sizes: list[int]) -> None:
        layer.bnb_compute_dtype = torch.get_default_dtype()
        rows = sum(output_sizes)
        loader = lambda param, loaded, shard_id=None: load_int8(layer, param, loaded, shard_id)  # noqa: E731
        layer.weight = new_param(rows, input_size, dtype=torch.int8, output_dim=0, input_dim=1, weight_loader=loader)
        layer.SCB = new_param(rows, dtype=torch.float32, output_dim=0, weight_loader=layer.weight_loader)  # [N]

    def process_weights_after_loading(self, layer: LinearBase) -> LinearMethod:
        scale = layer.SCB.data.float() * WEIGHT_DEQUANT  # [N]
        del layer.SCB
        weight = layer.weight.data  # [N, K] int8
        if kernel_device(weight.device):
            del layer.weight
            unsigned = weight.t().to(torch.int32) + 128  # [K, N], midpoint 128
            layer.wq_packed = nn.Parameter(pack_int32(unsigned, 8, dim=0), requires_grad=False)  # [K / 4, N]
            layer.wq_scales = nn.Parameter(scale[None, :].contiguous(), requires_grad=False)  # [1, N]
            return LLMInt8GemmMethod(self.threshold, weight.shape[1])
        dense = (weight.float() * scale[:, None]).to(layer.bnb_compute_dtype)  # [N, K]
        layer.weight = nn.Parameter(dense, requires_grad=False)
        return LLMInt8Method(pack_dense(layer), self.threshold)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{layer.prefix}: 8-bit weights run after process_weights_after_loading")


class LLMInt8Method(LinearMethodVariant):
    """The input through LLM.int8's rule, then `dense` (the dequantized weight's packing)."""

    def __init__(self, dense: LinearMethod, threshold: float) -> None:
        self.dense, self.threshold = dense, threshold

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        x2 = llm_int8_input(x.reshape(-1, x.shape[-1]), self.threshold).reshape(x.shape)
        return self.dense.apply(layer, x2)


class LLMInt8GemmMethod(LinearMethodVariant):
    """CUDA: the input through LLM.int8's rule, then the W8A16 Triton GEMM on the int8 weight (one channel group)."""

    def __init__(self, threshold: float, in_features: int) -> None:
        self.threshold, self.in_features = threshold, in_features

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        x2 = llm_int8_input(x.reshape(-1, x.shape[-1]), self.threshold).reshape(x.shape)
        return wna16_linear(x2, layer.wq_packed, layer.wq_scales, None, layer.bias, None, 8, self.in_features)
