"""Gemma 2: Gemma with tanh soft-capping of the attention scores and of the final logits, sliding-window attention
on alternate layers (config.layer_types), RMSNorm after attention and around the MLP (pre/post feed-forward),
and attention scaled by query_pre_attn_scalar ** -0.5."""

from __future__ import annotations

import torch

from pagedllm.layers.attention import Attention
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.models.gemma import GemmaAttention, GemmaDecoderLayer, GemmaForCausalLM, GemmaModel
from pagedllm.models.utils import sliding_window_for_layer


class Gemma2Attention(GemmaAttention):
    def make_attention(self, config, layer_idx: int) -> Attention:
        scale = config.query_pre_attn_scalar**-0.5
        window = sliding_window_for_layer(config, layer_idx)
        cap = getattr(config, "attn_logit_softcapping", None)
        return Attention(self.num_heads, self.head_dim, scale, self.num_kv_heads, window, logits_soft_cap=cap)


class Gemma2DecoderLayer(GemmaDecoderLayer):
    attention_cls = Gemma2Attention

    def __init__(
        self, config, layer_idx: int, quant_config: QuantizationConfig | None = None, prefix: str = ""
    ) -> None:
        super().__init__(config, layer_idx, quant_config, prefix)
        self.pre_feedforward_layernorm = self.norm_cls(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = self.norm_cls(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(rope, x))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma2Model(GemmaModel):
    layer_cls = Gemma2DecoderLayer


class Gemma2ForCausalLM(GemmaForCausalLM):
    model_cls = Gemma2Model

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        logits = super().compute_logits(hidden, upcast)  # [n, vocab]
        cap = getattr(self.config, "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits
