"""SiLU-and-mul: the gated MLP's activation over [gate | up] halves."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., 2 * d] -> [..., d]
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
