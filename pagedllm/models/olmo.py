"""OLMo: the Llama architecture with LayerNorm that has no weight or bias (epsilon 1e-5), and q/k/v optionally
clamped to [-clip_qkv, clip_qkv]."""

from __future__ import annotations

import torch

from pagedllm.layers.layernorm import LayerNorm
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.layers.rotary_embedding import apply_qk_rotary
from pagedllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


def olmo_norm(hidden_size: int, eps: float = 1e-5) -> LayerNorm:
    return LayerNorm(hidden_size, 1e-5, affine=False)  # OLMo's epsilon is fixed


class OlmoAttention(LlamaAttention):
    def __init__(
        self, config, layer_idx: int, quant_config: QuantizationConfig | None = None, prefix: str = ""
    ) -> None:
        super().__init__(config, layer_idx, quant_config, prefix)
        self.clip_qkv = getattr(config, "clip_qkv", None)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        clip = self.clip_qkv
        qkv = self.qkv_proj(x)
        if clip is not None:
            qkv = qkv.clamp(-clip, clip)
        n = x.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = apply_qk_rotary(
            q.view(n, self.num_heads, self.head_dim), k.view(n, self.num_kv_heads, self.head_dim), rope
        )
        return self.o_proj(self.attn(q.reshape(n, -1), k.reshape(n, -1), v))


class OlmoDecoderLayer(LlamaDecoderLayer):
    attention_cls = OlmoAttention
    norm_cls = staticmethod(olmo_norm)


class OlmoModel(LlamaModel):
    layer_cls = OlmoDecoderLayer
    norm_cls = staticmethod(olmo_norm)


class OlmoForCausalLM(LlamaForCausalLM):
    model_cls = OlmoModel
