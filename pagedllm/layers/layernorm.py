"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.kernels import cpu_kernels, use_triton


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or with a residual: (norm(x + residual), x + residual)."""
        if use_triton(x):  # CUDA: one fused Triton kernel
            from pagedllm.kernels.fused_ops import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        if cpu_kernels.runs(x):  # CPU: one C pass
            return cpu_kernels.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual
