"""Qwen3-MoE: Qwen3's attention (RMSNorm per head of q and k) with a softmax top-k MoE (renormalized when
`norm_topk_prob`); layers in `mlp_only_layers` or off the `decoder_sparse_step` keep a dense MLP."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from pagedllm.models.mixtral import MoEBlock, load_moe_weights
from pagedllm.models.qwen3 import Qwen3Attention


def is_sparse_layer(config, layer_idx: int) -> bool:
    """HF's rule: a layer has experts unless listed in mlp_only_layers or off the decoder_sparse_step."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (
        layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer_idx + 1) % step == 0
    )


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention

    def __init__(
        self, config, layer_idx: int, quant_config: QuantizationConfig | None = None, prefix: str = ""
    ) -> None:
        self.sparse = is_sparse_layer(config, layer_idx)  # read by make_mlp during the base constructor
        super().__init__(config, layer_idx, quant_config, prefix)

    def make_mlp(self, config, quant_config: QuantizationConfig | None, prefix: str) -> nn.Module:
        if not self.sparse:
            return LlamaDecoderLayer.make_mlp(config, quant_config, prefix)
        return self.make_moe(config, quant_config, prefix)

    @staticmethod
    def make_moe(config, quant_config: QuantizationConfig | None, prefix: str) -> nn.Module:
        renormalize = bool(getattr(config, "norm_topk_prob", False))
        return MoEBlock(config, config.moe_intermediate_size, renormalize, quant_config, prefix)


class Qwen3MoeModel(LlamaModel):
    layer_cls = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3MoeModel

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_moe_weights(self, weights)
