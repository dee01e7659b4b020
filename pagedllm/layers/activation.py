"""SiLU-and-mul: the gated MLP's activation over [gate | up] halves."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import cpu_kernels, use_triton


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., 2 * d] -> [..., d]
        if use_triton(x):  # CUDA: one fused Triton kernel
            from pagedllm.kernels.fused_ops import silu_and_mul

            return silu_and_mul(x)
        if cpu_kernels.runs(x):  # CPU: one C pass
            return cpu_kernels.silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
