"""RMSNorm (and Gemma's 1 + weight form) and LayerNorm, optionally fused with the residual add before them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import cpu_kernels, use_triton


class RMSNorm(nn.Module):
    """reduce_group (set by a model, models/llama.py: defer_reductions): x is a row-parallel layer's partial output,
    summed over the group's ranks here, fused with the residual add and the norm where the group has a kernel for it
    (Communicator.all_reduce_rms_norm). fp8_output_for (set by a model whose norm output goes to one linear layer
    only: that layer's takes_fp8_input): on CUDA, where it says so for the rows, the norm's kernel returns them
    quantized (an fp8_ops.QuantizedActivations)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.reduce_group = None  # Communicator | None
        self.fp8_output_for = None  # Callable[[torch.Tensor], bool] | None

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or with a residual: (norm(x + residual), x + residual)."""
        if self.reduce_group is not None:
            if residual is not None:
                fused = self.reduce_group.all_reduce_rms_norm(x, residual, self.weight, self.eps)
                if fused is not None:
                    return fused
            self.reduce_group.all_reduce(x)
        if use_triton(x):  # CUDA: one fused Triton kernel
            from pagedllm.kernels.fused_ops import rms_norm

            if self.fp8_output_for is not None and x.dtype == self.weight.dtype and self.fp8_output_for(x):
                from pagedllm.layers.quantization.fp8_ops import as_quantized

                return as_quantized(rms_norm(x, self.weight, self.eps, residual, quantize=True), x.dtype)
            return rms_norm(x, self.weight, self.eps, residual)
        if cpu_kernels.runs(x):  # CPU: one C pass
            return cpu_kernels.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm scales by (1 + weight): the checkpoint's weight plus one, added once after loading."""

    def process_weights_after_loading(self) -> None:
        self.weight.data += 1.0


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (and optionally no affine weight at all), with RMSNorm's residual form."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True, affine: bool = True) -> None:
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False) if affine else None
        self.bias = nn.Parameter(torch.empty(hidden_size), requires_grad=False) if affine and bias else None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or with a residual: (norm(x + residual), x + residual)."""
        if residual is not None:
            residual = x + residual
            return F.layer_norm(residual, (self.hidden_size,), self.weight, self.bias, self.eps), residual
        return F.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)


class ShardedRMSNorm(RMSNorm):
    """RMSNorm over a vector split across the tensor-parallel ranks (OLMo 2's norm over a whole q or k projection):
    each rank holds its slice of x and of the weight; the sum of squares is added over the ranks (a [n, 1]
    all-reduce). `replicas`: ranks holding the same slice (KV heads replicated over more ranks than heads), counted
    once. With one rank it is RMSNorm."""

    def __init__(self, full_size: int, local_size: int, eps: float, context, replicas: int = 1) -> None:
        super().__init__(local_size, eps)
        self.full_size, self.replicas, self.tp_group = full_size, replicas, context.tp_group
        self.offset = (context.tp_rank // replicas) * local_size
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        param.data.copy_(loaded.narrow(0, self.offset, param.shape[0]))

    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor:
        if self.tp_group is None:
            return super().forward(x)
        h = x.float()
        squares = self.tp_group.all_reduce(h.pow(2).sum(-1, keepdim=True))  # [n, 1] over the whole vector
        h = h * torch.rsqrt(squares / (self.replicas * self.full_size) + self.eps)
        return self.weight * h.to(x.dtype)
