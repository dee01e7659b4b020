"""Qwen2-MoE (Qwen1.5-MoE): Qwen2's attention (bias on q/k/v) with a softmax top-k MoE plus a shared expert, a
dense gated MLP scaled by sigmoid(shared_expert_gate(x)) added to the routed experts' sum."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.layers.linear import ReplicatedLinear
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel
from pagedllm.models.mixtral import MoEBlock, load_moe_weights
from pagedllm.models.qwen3_moe import Qwen3MoeDecoderLayer
from pagedllm.models.utils import join_prefix


class Qwen2MoeAttention(LlamaAttention):
    @staticmethod
    def biases(config) -> tuple[bool, bool]:
        return bool(getattr(config, "qkv_bias", True)), False


class Qwen2MoeSparseBlock(MoEBlock):
    def __init__(self, config, quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        renormalize = bool(getattr(config, "norm_topk_prob", False))
        super().__init__(config, config.moe_intermediate_size, renormalize, quant_config, prefix)
        self.shared_expert = LlamaMLP(
            config.hidden_size,
            config.shared_expert_intermediate_size,
            quant_config=quant_config,
            prefix=join_prefix(prefix, "shared_expert"),
            act=config.hidden_act,
        )
        self.shared_expert_gate = ReplicatedLinear(
            config.hidden_size, 1, False, None, join_prefix(prefix, "shared_expert_gate")
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)  # [n, H]
        return super().forward(x) + shared


class Qwen2MoeDecoderLayer(Qwen3MoeDecoderLayer):
    attention_cls = Qwen2MoeAttention

    @staticmethod
    def make_moe(config, quant_config: QuantizationConfig | None, prefix: str) -> nn.Module:
        return Qwen2MoeSparseBlock(config, quant_config, prefix)


class Qwen2MoeModel(LlamaModel):
    layer_cls = Qwen2MoeDecoderLayer


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    model_cls = Qwen2MoeModel

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_moe_weights(self, weights)
