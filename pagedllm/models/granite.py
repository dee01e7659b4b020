"""Granite: the Llama architecture with four multipliers: on the embedding (embedding_multiplier), the attention
scale (attention_multiplier), each block's output before the residual add (residual_multiplier), and the logits
divided by logits_scaling."""

from __future__ import annotations

import torch

from pagedllm.layers.attention import Attention
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from pagedllm.models.utils import sliding_window_for_layer


class GraniteAttention(LlamaAttention):
    def make_attention(self, config, layer_idx: int) -> Attention:
        window = sliding_window_for_layer(config, layer_idx)
        return Attention(self.num_heads, self.head_dim, config.attention_multiplier, self.num_kv_heads, window)


class GraniteDecoderLayer(LlamaDecoderLayer):
    attention_cls = GraniteAttention

    def __init__(
        self, config, layer_idx: int, quant_config: QuantizationConfig | None = None, prefix: str = ""
    ) -> None:
        super().__init__(config, layer_idx, quant_config, prefix)
        self.residual_multiplier = config.residual_multiplier

    def forward(
        self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each block's output leaves scaled; the next norm adds it to the residual stream."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(rope, x) * self.residual_multiplier, residual)
        return self.mlp(x) * self.residual_multiplier, residual


class GraniteModel(LlamaModel):
    layer_cls = GraniteDecoderLayer

    def embed_inputs(self, embeds: torch.Tensor) -> torch.Tensor:
        return embeds * self.embedding_multiplier  # [num_tokens, hidden]

    def __init__(
        self, config, quant_config: QuantizationConfig | None = None, prefix: str = "", *, max_position: int
    ) -> None:
        super().__init__(config, quant_config, prefix, max_position=max_position)
        self.embedding_multiplier = config.embedding_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    model_cls = GraniteModel

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        return super().compute_logits(hidden, upcast) / self.config.logits_scaling  # [n, vocab]
