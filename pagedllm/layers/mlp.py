"""The plain (non-gated) feed-forward block: up projection, activation, down projection."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.activation import Activation
from pagedllm.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedllm.layers.quantization import QuantizationConfig


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class PlainMLP(nn.Module):
    """down(act(up(x))); `names` are the checkpoint's names of the two projections (fc1/fc2, c_fc/c_proj, ...)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        act: str,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        names: tuple[str, str] = ("fc1", "fc2"),
    ) -> None:
        super().__init__()
        self.up_name, self.down_name = names
        up = ColumnParallelLinear(hidden_size, intermediate_size, bias, quant_config, _join(prefix, names[0]))
        down = RowParallelLinear(intermediate_size, hidden_size, bias, quant_config, _join(prefix, names[1]))
        self.add_module(names[0], up)
        self.add_module(names[1], down)
        self.act = Activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.down_name)(self.act(getattr(self, self.up_name)(x)))
