"""SiLU-and-mul: the gated MLP's activation over [gate | up] halves."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import cpu_kernels, use_triton


class SiluAndMul(nn.Module):
    """fp8_output_for: as RMSNorm's (set by a model: the down projection's takes_fp8_input); the rows it says so
    for come out quantized to fp8 per token."""

    def __init__(self) -> None:
        super().__init__()
        self.fp8_output_for = None  # Callable[[torch.Tensor], bool] | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., 2 * d] -> [..., d]
        if use_triton(x):  # CUDA: one fused Triton kernel
            from pagedllm.kernels.fused_ops import silu_and_mul

            if self.fp8_output_for is not None and self.fp8_output_for(x):
                from pagedllm.layers.quantization.fp8_ops import as_quantized

                return as_quantized(silu_and_mul(x, quantize=True), x.dtype)
            return silu_and_mul(x)
        if cpu_kernels.runs(x):  # CPU: one C pass
            return cpu_kernels.silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# HF `activation_function` / `hidden_act` names -> the element-wise function (gelu_new, gelu_fast and
# gelu_pytorch_tanh are all the tanh approximation; gelu is the exact erf form)
_ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "silu": F.silu,
    "swish": F.silu,
}


def activation_fn(name: str):
    """The element-wise activation named by an HF config."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class Activation(nn.Module):
    """An HF-named element-wise activation as a module (non-gated MLPs)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.fn = activation_fn(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


class ActAndMul(nn.Module):
    """act(gate) * up over [gate | up] halves, for any named activation (SiLU takes the fused SiluAndMul)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.fn = activation_fn(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., 2 * d] -> [..., d]
        d = x.shape[-1] // 2
        return self.fn(x[..., :d]) * x[..., d:]


def gated_activation(name: str) -> nn.Module:
    return SiluAndMul() if activation_fn(name) is F.silu else ActAndMul(name)
