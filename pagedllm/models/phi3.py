"""Phi-3 / Phi-4-mini: the Llama architecture with q/k/v (qkv_proj) and gate/up (gate_up_proj) stored fused in the
checkpoint, as pagedllm lays them out, rotary over the first partial_rotary_factor of each head, and LongRoPE."""

from __future__ import annotations

import torch

from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.layers.rotary_embedding import RotaryEmbedding, apply_partial_rotary, partial_rotary_dim, rope_parameters
from pagedllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from pagedllm.models.utils import head_dim_of


class Phi3Attention(LlamaAttention):
    def __init__(
        self, config, layer_idx: int, quant_config: QuantizationConfig | None = None, prefix: str = ""
    ) -> None:
        super().__init__(config, layer_idx, quant_config, prefix)
        self.rot_dim = partial_rotary_dim(config, self.head_dim)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(n, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        q, k = apply_partial_rotary(q, k, rope, self.rot_dim)
        return self.o_proj(self.attn(q.reshape(n, -1), k.reshape(n, -1), v))


class Phi3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Phi3Attention


class Phi3Model(LlamaModel):
    layer_cls = Phi3DecoderLayer

    def make_rotary(self, config, max_position: int) -> RotaryEmbedding:
        rot_dim = partial_rotary_dim(config, head_dim_of(config))
        theta, scaling = rope_parameters(config)
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "longrope":
            original = scaling.get("original_max_position_embeddings") or config.original_max_position_embeddings
            extra = {
                "original_max_position_embeddings": original,
                "max_position_embeddings": config.max_position_embeddings,
            }
            scaling = {**scaling, **extra}
        return RotaryEmbedding(rot_dim, max_position, theta, scaling)


class Phi3ForCausalLM(LlamaForCausalLM):
    model_cls = Phi3Model
