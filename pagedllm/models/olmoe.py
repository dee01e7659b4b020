"""OLMoE: the Llama layers (pre-norm) with RMSNorm over the whole q and k projections before rotary (as OLMo 2),
q/k/v optionally clamped to [-clip_qkv, clip_qkv] after it, and a softmax top-k MoE (`norm_topk_prob`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.layers.rotary_embedding import apply_qk_rotary
from pagedllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from pagedllm.models.mixtral import MoEBlock, load_moe_weights
from pagedllm.models.olmo2 import Olmo2Attention


class OlmoeAttention(Olmo2Attention):
    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)
        clip = getattr(self, "clip_qkv", None)
        if clip is not None:
            q, k, v = q.clamp(-clip, clip), k.clamp(-clip, clip), v.clamp(-clip, clip)
        q = q.view(n, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(n, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        q, k = apply_qk_rotary(q, k, rope)
        return self.o_proj(self.attn(q.reshape(n, -1), k.reshape(n, -1), v))


class OlmoeDecoderLayer(LlamaDecoderLayer):
    attention_cls = OlmoeAttention

    def __init__(
        self, config, layer_idx: int, quant_config: QuantizationConfig | None = None, prefix: str = ""
    ) -> None:
        super().__init__(config, layer_idx, quant_config, prefix)
        self.self_attn.clip_qkv = getattr(config, "clip_qkv", None)

    @staticmethod
    def make_mlp(config, quant_config: QuantizationConfig | None, prefix: str) -> nn.Module:
        renormalize = bool(getattr(config, "norm_topk_prob", False))
        return MoEBlock(config, config.intermediate_size, renormalize, quant_config, prefix)


class OlmoeModel(LlamaModel):
    layer_cls = OlmoeDecoderLayer


class OlmoeForCausalLM(LlamaForCausalLM):
    model_cls = OlmoeModel

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_moe_weights(self, weights)
