"""Mixtral: the Llama layers with a sparse mixture of experts in place of the MLP (softmax router over
`num_local_experts`, the top `num_experts_per_tok` renormalized). Also the MoE block the other MoE families share."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.layers.fused_moe import FusedMoE, expert_stacked_params
from pagedllm.layers.linear import ReplicatedLinear
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from pagedllm.models.utils import STACKED_PARAMS, join_prefix, load_weights, tied_ignore

# experts stored fused per layer (transformers' in-memory layout) -> our stacked parameters
_FUSED_EXPERT_NAMES = ((".experts.gate_up_proj", ".experts.w13_weight"), (".experts.down_proj", ".experts.w2_weight"))


def num_experts_of(config) -> int:
    return int(getattr(config, "num_local_experts", None) or config.num_experts)


class MoEBlock(nn.Module):
    """A router (`gate`, [E, H], no bias) and the routed experts: forward(x [n, H]) -> [n, H]."""

    def __init__(
        self,
        config,
        intermediate_size: int,
        renormalize: bool,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        num_experts = num_experts_of(config)
        self.gate = ReplicatedLinear(config.hidden_size, num_experts, False, None, join_prefix(prefix, "gate"))
        self.experts = FusedMoE(
            num_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            intermediate_size,
            renormalize,
            quant_config,
            join_prefix(prefix, "experts"),
            activation=getattr(config, "hidden_act", "silu"),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))  # router logits [n, E]


def load_moe_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    rename: tuple[tuple[str, str], ...] = (),
) -> set[str]:
    """load_weights with the per-expert checkpoint names (`names`: gate, up, down) mapped onto the stacked expert
    parameters, ahead of the dense merged projections; `rename` replaces name fragments first."""
    stacked = expert_stacked_params(num_experts_of(model.config), names) + STACKED_PARAMS
    pairs = rename + _FUSED_EXPERT_NAMES

    def renamed(name: str) -> str:
        for theirs, ours in pairs:
            name = name.replace(theirs, ours)
        return name

    return load_weights(model, weights, stacked, renamed, tied_ignore(model.tied))


class MixtralDecoderLayer(LlamaDecoderLayer):
    @staticmethod
    def make_mlp(config, quant_config: QuantizationConfig | None, prefix: str) -> nn.Module:
        return MoEBlock(config, config.intermediate_size, True, quant_config, prefix)


class MixtralModel(LlamaModel):
    layer_cls = MixtralDecoderLayer


class MixtralForCausalLM(LlamaForCausalLM):
    """The MoE block sits at `mlp` (the checkpoint's `block_sparse_moe`), its experts named w1 (gate), w3, w2."""

    model_cls = MixtralModel

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_moe_weights(self, weights, ("w1", "w3", "w2"), ((".block_sparse_moe.", ".mlp."),))
