"""OLMo 2: the Llama layers with the norms moved after each block (x + norm(attn(x)), x + norm(mlp(x)), no input
norm) and RMSNorm over the whole q and k projections (not per head) before rotary."""

from __future__ import annotations

import torch

from pagedllm.layers.build_context import current_build_context
from pagedllm.layers.layernorm import RMSNorm, ShardedRMSNorm
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.layers.rotary_embedding import apply_qk_rotary
from pagedllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Olmo2Attention(LlamaAttention):
    def __init__(
        self, config, layer_idx: int, quant_config: QuantizationConfig | None = None, prefix: str = ""
    ) -> None:
        super().__init__(config, layer_idx, quant_config, prefix)
        context, qkv = current_build_context(), self.qkv_proj
        total_q, total_kv = qkv.total_num_heads * self.head_dim, qkv.total_num_kv_heads * self.head_dim
        self.q_norm = ShardedRMSNorm(total_q, self.q_size, config.rms_norm_eps, context)
        self.k_norm = ShardedRMSNorm(total_kv, self.kv_size, config.rms_norm_eps, context, qkv.kv_replicas)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q).view(n, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = self.k_norm(k).view(n, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        q, k = apply_qk_rotary(q, k, rope)
        return self.o_proj(self.attn(q.reshape(n, -1), k.reshape(n, -1), v))


class Olmo2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Olmo2Attention

    def __init__(
        self, config, layer_idx: int, quant_config: QuantizationConfig | None = None, prefix: str = ""
    ) -> None:
        super().__init__(config, layer_idx, quant_config, prefix)
        del self.input_layernorm
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream stays in x (post-norm blocks have nothing to fuse); residual is unused."""
        x = x + self.post_attention_layernorm(self.self_attn(rope, x))
        return x + self.post_feedforward_layernorm(self.mlp(x)), None


class Olmo2Model(LlamaModel):
    layer_cls = Olmo2DecoderLayer


class Olmo2ForCausalLM(LlamaForCausalLM):
    model_cls = Olmo2Model
