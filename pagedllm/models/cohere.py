"""Cohere Command-R: one LayerNorm (weight, no bias) feeding attention and the gated SiLU MLP in parallel, rotary
in the interleaved layout, optional per-head LayerNorm of q and k (a weight per head), and logits multiplied by
logit_scale; the LM head is tied to the embedding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.layernorm import LayerNorm
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.layers.rotary_embedding import apply_partial_rotary
from pagedllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


def cohere_norm(hidden_size: int, eps: float) -> LayerNorm:
    return LayerNorm(hidden_size, eps, bias=False)


class HeadLayerNorm(nn.Module):
    """LayerNorm over each head's dims with its own weight per head: weight [num_heads, head_dim], this rank's heads
    from first_head on (the checkpoint holds all of them)."""

    def __init__(self, num_heads: int, head_dim: int, eps: float, first_head: int = 0) -> None:
        super().__init__()
        self.eps, self.first_head = eps, first_head
        self.weight = nn.Parameter(torch.empty(num_heads, head_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        param.data.copy_(loaded.narrow(0, self.first_head, param.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        return F.layer_norm(x.float(), x.shape[-1:], eps=self.eps).mul_(self.weight.float()).to(x.dtype)


class CohereAttention(LlamaAttention):
    def __init__(
        self, config, layer_idx: int, quant_config: QuantizationConfig | None = None, prefix: str = ""
    ) -> None:
        super().__init__(config, layer_idx, quant_config, prefix)
        self.use_qk_norm = bool(getattr(config, "use_qk_norm", False))
        if self.use_qk_norm:
            qkv, eps = self.qkv_proj, config.layer_norm_eps
            first_kv = (qkv.tp_rank // qkv.kv_replicas) * self.num_kv_heads
            self.q_norm = HeadLayerNorm(self.num_heads, self.head_dim, eps, qkv.tp_rank * self.num_heads)
            self.k_norm = HeadLayerNorm(self.num_kv_heads, self.head_dim, eps, first_kv)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(n, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_partial_rotary(q, k, rope, self.head_dim, interleaved=True)
        return self.o_proj(self.attn(q.reshape(n, -1), k.reshape(n, -1), v))


class CohereDecoderLayer(LlamaDecoderLayer):
    attention_cls = CohereAttention
    norm_cls = staticmethod(cohere_norm)

    def __init__(
        self, config, layer_idx: int, quant_config: QuantizationConfig | None = None, prefix: str = ""
    ) -> None:
        super().__init__(config, layer_idx, quant_config, prefix)
        del self.post_attention_layernorm

    def forward(
        self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, None]:
        h = self.input_layernorm(x)
        return x + self.self_attn(rope, h) + self.mlp(h), None


class CohereModel(LlamaModel):
    layer_cls = CohereDecoderLayer
    norm_cls = staticmethod(cohere_norm)


class CohereForCausalLM(LlamaForCausalLM):
    model_cls = CohereModel

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        return super().compute_logits(hidden, upcast) * self.config.logit_scale  # [n, vocab]
