"""Which implementation samples: the Triton kernels (CUDA with triton), the C kernels (CPU with a built library) or
torch ops (elsewhere). Chosen once, when a sampler is built; every sampler function takes the choice."""

from __future__ import annotations

import torch

from pagedllm.kernels import cpu_kernels, triton_available

TRITON, C, TORCH = "triton", "c", "torch"


def choose_impl(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda" and triton_available():
        return TRITON
    if device.type == "cpu" and cpu_kernels.compiled() is not None:
        return C
    return TORCH


def impl_of(x: torch.Tensor) -> str:
    """The implementation that takes x's rows as they are (the C kernels read float32 only)."""
    impl = choose_impl(x.device)
    return TORCH if impl == C and x.dtype != torch.float32 else impl
