"""bitsandbytes checkpoints (quant_method "bitsandbytes", as transformers saves a model loaded with
`BitsAndBytesConfig`): 4-bit nf4 / fp4 weights (with or without double quantization of their scales) and 8-bit
LLM.int8 weights; and `quantization="bitsandbytes"` of a float checkpoint, quantized to 4-bit nf4 while loading (as
vLLM does; blocks of 64, scales kept in float32: no double quantization). The stored tensors are decoded in plain
torch (bnb_format.py); the bitsandbytes package is not needed.

Which path runs where:
- 4-bit on CUDA (with Triton): the codes repacked into the W4A16 GEMM's K-packed int32 layout with a scale per g input
  features (g = gcd(K, 64)) and the 16-value codebook; wna16_gemm.py's Triton GEMMs in their codebook variant
  (w = codebook[q] * scale): fused dequant-GEMM for decode batches, dequantize-then-GEMM for large ones.
- 4-bit elsewhere (CPU): the weight dequantized once at load to the compute dtype, then the dense method's packing
  (oneDNN / AMX tiles).
- 8-bit: each matmul's input goes through LLM.int8's activation rule first (bnb_int8.py), the same numbers
  bitsandbytes' int8 GEMM computes with; on CUDA the int8 weight stays 8-bit for the W8A16 Triton GEMM, elsewhere it is
  dequantized once at load (int8 * SCB / 127) for the dense path."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.layers.linear import DENSE, LinearBase, new_param, pack_dense
from pagedllm.layers.quantization.base import LinearMethod, LinearMethodVariant, QuantizationConfig
from pagedllm.layers.quantization.bnb_format import (
    QUANT_TYPES,
    STORAGE_DTYPES,
    codebook,
    dequantize_4bit,
    quantize_nf4,
    regroup_4bit,
    scale_group,
    unpack_rows,
)
from pagedllm.layers.quantization.bnb_int8 import Int8WeightMethod, drop_weight_format
from pagedllm.layers.quantization.int_packing import pack_int32
from pagedllm.layers.quantization.wna16 import kernel_device, load_part, not_converted
from pagedllm.layers.quantization.wna16_gemm import wna16_linear

COMPUTE_DTYPES = ("float32", "float16", "bfloat16")


def load_codes(layer: LinearBase, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    """4-bit codes uint8 [N, ceil(K / 2)] (two per byte along the row) of one projection into this rank's part."""
    if loaded.dtype != torch.uint8:
        raise ValueError(
            f"{layer.prefix}: a bitsandbytes 4-bit layer got codes of dtype {loaded.dtype} (is this projection stored "
            "unquantized? then name it in llm_int8_skip_modules)"
        )
    load_part(layer, 1, 2, param, loaded, shard_id)


def load_scales(layer: LinearBase, g: int, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    """Scales float32 [N, K / g0] (g0 = gcd(K, 64), as decoded) into this rank's part of [N, K / g]; g (which divides
    g0) is finer where a row-parallel rank's input features are not a multiple of g0."""
    g0 = layer.input_size // loaded.shape[1]
    if g0 != g:
        loaded = loaded.repeat_interleave(g0 // g, dim=1)  # each run of g0 features split into runs of g
    load_part(layer, 1, g, param, loaded, shard_id)


class Bnb4bitLinearMethod(LinearMethod):
    """Loading: codes uint8 [N, ceil(K / 2)] (`bnb_codes`, two per byte: half a byte per weight while loading too)
    and scales float32 [N, K / g] (`bnb_scales`), as bnb_format.regroup_4bit decodes them; the codes' values are the
    quant_type's table. Of a float checkpoint (`serialized=False`): the float weight, quantized to nf4 after
    loading."""

    def __init__(self, quant_type: str, serialized: bool = True) -> None:
        self.quant_type, self.serialized = quant_type, serialized

    def create_weights(self, layer: LinearBase, input_size: int, output_sizes: list[int]) -> None:
        layer.bnb_compute_dtype = torch.get_default_dtype()
        if not self.serialized:
            DENSE.create_weights(layer, input_size, output_sizes)
            return
        g = scale_group(input_size)  # this rank's input features: a row-parallel shard holds whole groups
        if input_size != layer.input_size and input_size % 2:
            raise ValueError(
                f"{layer.prefix}: each tensor-parallel rank's {input_size} input features split the 4-bit codes' "
                "bytes (two features each); use a tensor_parallel_size that leaves an even number"
            )
        rows, codes_loader = sum(output_sizes), functools.partial(load_codes, layer)
        layer.bnb_codes = new_param(
            rows, -(-input_size // 2), dtype=torch.uint8, output_dim=0, weight_loader=codes_loader
        )
        scales_loader = functools.partial(load_scales, layer, g)
        layer.bnb_scales = new_param(
            rows, input_size // g, dtype=torch.float32, output_dim=0, weight_loader=scales_loader
        )

    def loaded(self, layer: LinearBase) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes [N, K], scales [N, K / g]), removed from the layer."""
        # of a float checkpoint: quantized here, each projection on its own (as the checkpoint's tensors would be);
        # under tensor parallelism each rank's shard, whose blocks differ from the whole weight's where a row-parallel
        # rank's input features are not a multiple of 64
        if not self.serialized:
            parts = [quantize_nf4(w) for w in layer.weight.data.split(layer.output_partition_sizes)]
            del layer.weight
            return torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts])
        out = unpack_rows(layer.bnb_codes.data, layer.input_size_per_partition), layer.bnb_scales.data
        del layer.bnb_codes, layer.bnb_scales
        return out

    def process_weights_after_loading(self, layer: LinearBase) -> LinearMethod:
        codes, scales = self.loaded(layer)
        table = codebook(self.quant_type, codes.device)  # [16]
        if kernel_device(codes.device):
            group = codes.shape[1] // scales.shape[1]
            layer.wq_packed = nn.Parameter(pack_int32(codes.t(), 4, dim=0), requires_grad=False)  # [K / 8, N]
            layer.wq_scales = nn.Parameter(scales.t().contiguous(), requires_grad=False)  # [K / g, N]
            layer.wq_codebook = nn.Parameter(table, requires_grad=False)  # [16]
            return Bnb4bitGemmMethod(group)
        weight = dequantize_4bit(codes, scales, table).to(layer.bnb_compute_dtype)  # [N, K]
        layer.weight = nn.Parameter(weight, requires_grad=False)
        return pack_dense(layer)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{layer.prefix}: 4-bit weights run after process_weights_after_loading")


class Bnb4bitGemmMethod(LinearMethodVariant):
    """CUDA: the K-packed codes (layer.wq_packed, wq_scales, wq_codebook) through the W4A16 Triton GEMMs."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        return wna16_linear(
            x, layer.wq_packed, layer.wq_scales, None, layer.bias, None, 4, self.group_size, layer.wq_codebook
        )


def _flag(config: dict[str, Any], name: str) -> bool:
    value = config.get(name, config.get(f"_{name}", False))
    if not isinstance(value, bool):
        raise ValueError(f"bitsandbytes: quantization_config.{name}={value!r} must be true or false")
    return value


def _check_choice(config: dict[str, Any], name: str, default: Any, supported: tuple) -> Any:
    value = config.get(name, default)
    value = default if value is None else value
    if value not in supported:
        raise ValueError(
            f"bitsandbytes: quantization_config.{name}={value!r} is not supported (supported: {list(supported)})"
        )
    return value


class BitsAndBytesConfig(QuantizationConfig):
    """Every linear layer quantized, except llm_int8_skip_modules (substrings of module names, as transformers
    matches them)."""

    name = "bitsandbytes"

    def __init__(
        self, bits: int, quant_type: str = "nf4", threshold: float = 6.0, skip: list[str] | None = None,
        storage: str = "uint8", serialized: bool = True,
    ) -> None:  # fmt: skip
        self.bits, self.quant_type, self.storage, self.skip = bits, quant_type, storage, list(skip or [])
        self.method = Bnb4bitLinearMethod(quant_type, serialized) if bits == 4 else Int8WeightMethod(threshold)
        self.serialized = serialized

    @classmethod
    def in_flight(cls) -> BitsAndBytesConfig:
        """quantization="bitsandbytes" of a float checkpoint: 4-bit nf4 at load."""
        return cls(4, "nf4", serialized=False)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> BitsAndBytesConfig:
        four, eight = _flag(config, "load_in_4bit"), _flag(config, "load_in_8bit")
        if four == eight:
            raise ValueError(
                f"bitsandbytes: quantization_config has load_in_4bit={four} and load_in_8bit={eight}; exactly one "
                "must be true"
            )
        _check_choice(config, "bnb_4bit_compute_dtype", "float32", COMPUTE_DTYPES)
        skip = config.get("llm_int8_skip_modules") or []
        if not (isinstance(skip, list) and all(isinstance(s, str) for s in skip)):
            raise ValueError(
                f"bitsandbytes: quantization_config.llm_int8_skip_modules={skip!r} must be a list of names"
            )
        if four:
            quant_type = _check_choice(config, "bnb_4bit_quant_type", "fp4", QUANT_TYPES)
            storage = _check_choice(config, "bnb_4bit_quant_storage", "uint8", STORAGE_DTYPES)
            return cls(4, quant_type, skip=skip, storage=storage)
        if config.get("llm_int8_has_fp16_weight"):
            raise ValueError(
                "bitsandbytes: quantization_config.llm_int8_has_fp16_weight=True is not supported (supported: False; "
                "such a checkpoint stores float weights)"
            )
        threshold = config.get("llm_int8_threshold", 6.0)
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or threshold < 0:
            raise ValueError(
                f"bitsandbytes: quantization_config.llm_int8_threshold={threshold!r} is not supported (supported: a "
                "number >= 0; 0 turns the outlier columns off)"
            )
        return cls(8, threshold=float(threshold), skip=skip)

    def get_linear_method(self, layer: LinearBase, prefix: str) -> LinearMethod | None:
        if not_converted(prefix, self.skip):
            return None
        return self.method

    def checkpoint_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        if not self.serialized:
            return weights
        if self.bits == 4:
            return regroup_4bit(weights, getattr(torch, self.storage), self.quant_type)
        return drop_weight_format(weights)
