"""FP8 routed experts ("fp8" checkpoints and compressed-tensors' FP8 schemes with per-tensor or per-channel weight
scales, dynamic activations): the experts' fp8 weights and their scales load into FusedMoE's stacked parameters and
are dequantized to the compute dtype once, after loading; the experts then run as float experts (the activations
entering them are not rounded to fp8: weight-only, on CPU and GPU alike). Other quantized experts are refused when
the model is built, before any weight loads."""

from __future__ import annotations

import functools

import torch
from torch import nn

from pagedllm.layers.linear import default_weight_loader, new_param
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.layers.quantization.fp8 import Fp8LinearMethod
from pagedllm.layers.quantization.fp8_ops import FP8_DTYPE

SUPPORTED = (
    "FP8 experts with per-tensor or per-channel weight scales and dynamic activations ('fp8', compressed-tensors)"
)


def expert_fp8_strategy(quant_config: QuantizationConfig | None, prefix: str) -> str | None:
    """ "tensor" | "channel": the experts' weights are FP8 with those scales; None: float experts. A ValueError names a
    quantization of the experts that is not supported."""
    if quant_config is None:
        return None
    name = getattr(quant_config, "name", type(quant_config).__name__)
    method = None
    if name in ("fp8", "compressed-tensors"):
        method = quant_config.get_linear_method(None, f"{prefix}.0.gate_proj")  # as the checkpoint names an expert
    if name in ("fp8", "compressed-tensors") and method is None:
        return None
    ok = isinstance(method, Fp8LinearMethod) and method.weight_strategy in ("tensor", "channel")
    if ok and not method.serialized:  # quantization="fp8" of a float checkpoint: the experts stay float
        return None
    if not ok or method.activations not in ("dynamic", "dynamic-tensor", None):
        scheme = f"{type(method).__name__} {vars(method)}" if method is not None else name
        raise ValueError(f"{prefix}: quantized experts ({name}: {scheme}) are not supported (supported: {SUPPORTED})")
    return method.weight_strategy


def create_fp8_expert_weights(moe: nn.Module, strategy: str) -> None:
    """w13_weight [E, 2I, H] and w2_weight [E, H, I] in fp8, with w13_weight_scale [E, 2] / [E, 2I] and
    w2_weight_scale [E, 1] / [E, H] float32 (per tensor / per channel; I: this rank's)."""
    e, h, inter, loader = moe.num_experts, moe.hidden_size, moe.intermediate_size, moe.weight_loader
    moe.w13_weight = new_param(e, 2 * inter, h, dtype=FP8_DTYPE, weight_loader=loader)
    moe.w2_weight = new_param(e, h, inter, dtype=FP8_DTYPE, weight_loader=loader)
    scale_loader = functools.partial(load_expert_scale, moe, strategy)
    rows13, rows2 = (2, 1) if strategy == "tensor" else (2 * inter, h)
    moe.w13_weight_scale = new_param(e, rows13, dtype=torch.float32, weight_loader=scale_loader)
    moe.w2_weight_scale = new_param(e, rows2, dtype=torch.float32, weight_loader=scale_loader)


def load_expert_scale(moe: nn.Module, strategy: str, param: torch.Tensor, loaded: torch.Tensor, shard_id) -> None:
    """One expert's projection scale (shard_id (expert, "w1" | "w3" | "w2")) into its slot: per tensor one value,
    per channel its rows (gate / up: this rank's rows of the intermediate dim; down: all H rows)."""
    if shard_id is None:
        raise ValueError(f"FP8 expert scales stored fused {tuple(loaded.shape)} are not supported; per-expert only")
    expert, shard = shard_id
    index = {"w1": 0, "w3": 1, "w2": 0}[shard]
    if strategy == "tensor":
        if loaded.numel() != 1:
            raise ValueError(f"a per-tensor FP8 expert scale has one element, got shape {tuple(loaded.shape)}")
        param.data[expert, index] = loaded.reshape(())
        return
    loaded = loaded.reshape(-1)  # [rows] (checkpoints store [rows, 1])
    inter = moe.intermediate_size
    if shard == "w2":
        default_weight_loader(param.data[expert], loaded)
        return
    target = param.data[expert, index * inter : (index + 1) * inter]
    default_weight_loader(target, loaded.narrow(0, moe.tp_rank * inter, inter))


def dequantize_experts(moe: nn.Module, dtype: torch.dtype) -> None:
    """The fp8 stacked weights times their scales, in `dtype`; the scales are dropped."""
    inter = moe.intermediate_size
    s13, s2 = moe.w13_weight_scale.data, moe.w2_weight_scale.data
    if s13.shape[1] == 2:  # per tensor: gate rows by the first scale, up rows by the second
        s13 = s13.repeat_interleave(inter, dim=1)  # [E, 2I]
    w13 = moe.w13_weight.data.float() * s13[:, :, None]  # [E, 2I, H]
    w2 = moe.w2_weight.data.float() * s2[:, :, None]  # [E, H, I] (s2 [E, 1] or [E, H])
    moe.w13_weight = nn.Parameter(w13.to(dtype), requires_grad=False)
    moe.w2_weight = nn.Parameter(w2.to(dtype), requires_grad=False)
    del moe.w13_weight_scale, moe.w2_weight_scale
