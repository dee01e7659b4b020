"""GPTBigCode (StarCoder, SantaCoder): GPT-2's blocks with multi-query attention (one K/V head when multi_query),
plain Linear weights (no Conv1D transpose) and, without multi-query, q/k/v fused per head in c_attn."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.attention import Attention
from pagedllm.layers.linear import QKVParallelLinear, RowParallelLinear
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.models.gpt2 import GPT2Block, GPT2LMHeadModel, GPT2Model
from pagedllm.models.utils import join_prefix, regroup_per_head_qkv


class GPTBigCodeAttention(nn.Module):
    def __init__(self, config, layer_idx: int, quant_config: QuantizationConfig | None = None, prefix: str = ""):
        super().__init__()
        hidden, total_heads = config.hidden_size, config.num_attention_heads
        self.head_dim = hidden // total_heads
        total_kv_heads = 1 if config.multi_query else total_heads  # one KV head: on every rank
        self.c_attn = QKVParallelLinear(
            hidden, self.head_dim, total_heads, total_kv_heads, True, quant_config, join_prefix(prefix, "c_attn")
        )
        self.num_heads, self.num_kv_heads = self.c_attn.num_heads, self.c_attn.num_kv_heads  # this rank's
        self.q_size, self.kv_size = self.c_attn.q_size, self.c_attn.kv_size
        self.c_proj = RowParallelLinear(hidden, hidden, True, quant_config, join_prefix(prefix, "c_proj"))
        scale = self.head_dim**-0.5 if getattr(config, "scale_attn_weights", True) else 1.0
        self.attn = Attention(self.num_heads, self.head_dim, scale, self.num_kv_heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.c_proj(self.attn(q, k, v))


class GPTBigCodeBlock(GPT2Block):
    attention_cls = GPTBigCodeAttention


class GPTBigCodeModel(GPT2Model):
    block_cls = GPTBigCodeBlock


class GPTBigCodeForCausalLM(GPT2LMHeadModel):
    model_cls = GPTBigCodeModel

    def convert(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Plain Linear weights; without multi-query, c_attn's rows are per head: regrouped to q, k, v."""
        if ".c_attn." in name and not self.config.multi_query:
            return regroup_per_head_qkv(tensor, self.config.num_attention_heads)
        return tensor
