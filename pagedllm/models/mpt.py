"""MPT: ALiBi instead of positions (MPT's slopes, alibi_bias_max), LayerNorm without bias, fused q/k/v (Wqkv,
optionally clamped to clip_qkv), an exact-GELU MLP, and no bias on any projection (no_bias)."""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedllm.layers.attention import Attention
from pagedllm.layers.layernorm import LayerNorm
from pagedllm.layers.linear import QKVParallelLinear, RowParallelLinear
from pagedllm.layers.mlp import PlainMLP
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.layers.vocab_embedding import VocabParallelEmbedding
from pagedllm.models.causal_lm import CausalLM
from pagedllm.models.stages import build_stage, drop_other_stages, to_next_stage
from pagedllm.models.utils import join_prefix, rank_alibi_slopes


def mpt_alibi_slopes(num_heads: int, alibi_bias_max: float) -> torch.Tensor:
    """[num_heads]: 2^-(i * max / n) for i = 1..n over the next power of two n, odd ones first when cut down."""
    n = 2 ** math.ceil(math.log2(num_heads))
    slopes = 1.0 / torch.pow(2, torch.arange(1, n + 1, dtype=torch.float32) * (alibi_bias_max / n))
    if n != num_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:num_heads]
    return slopes


class MPTAttention(nn.Module):
    def __init__(self, config, quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        hidden, num_heads, attn_config = config.hidden_size, config.num_attention_heads, config.attn_config
        head_dim, bias = hidden // num_heads, not config.no_bias
        self.clip_qkv = attn_config.clip_qkv
        self.Wqkv = QKVParallelLinear(
            hidden, head_dim, num_heads, num_heads, bias, quant_config, join_prefix(prefix, "Wqkv")
        )
        self.out_proj = RowParallelLinear(hidden, hidden, bias, quant_config, join_prefix(prefix, "out_proj"))
        scale = attn_config.softmax_scale or head_dim**-0.5
        slopes = mpt_alibi_slopes(num_heads, attn_config.alibi_bias_max) if attn_config.alibi else None
        slopes = rank_alibi_slopes(slopes, self.Wqkv) if slopes is not None else None  # this rank's heads
        rank_heads = self.Wqkv.num_heads
        self.attn = Attention(rank_heads, head_dim, scale, rank_heads, alibi_slopes=slopes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.Wqkv(x)
        if self.clip_qkv:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        q, k, v = qkv.chunk(3, dim=-1)
        return self.out_proj(self.attn(q, k, v))


class MPTBlock(nn.Module):
    def __init__(self, config, quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        hidden, eps, bias = config.hidden_size, config.layer_norm_epsilon, not config.no_bias
        self.norm_1 = LayerNorm(hidden, eps, bias=bias)
        self.attn = MPTAttention(config, quant_config, join_prefix(prefix, "attn"))
        self.norm_2 = LayerNorm(hidden, eps, bias=bias)
        inner, names = config.expansion_ratio * hidden, ("up_proj", "down_proj")
        self.ffn = PlainMLP(hidden, inner, bias, "gelu", quant_config, join_prefix(prefix, "ffn"), names)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.norm_1(x)
        else:
            x, residual = self.norm_1(x, residual)
        x, residual = self.norm_2(self.attn(x), residual)
        return self.ffn(x), residual


class MPTModel(nn.Module):
    def __init__(self, config, quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        hidden = config.hidden_size
        self.wte = VocabParallelEmbedding(config.vocab_size, hidden)
        self.blocks = build_stage(
            self, config.num_hidden_layers,
            lambda i: MPTBlock(config, quant_config, join_prefix(prefix, f"blocks.{i}")),
        )  # fmt: skip
        self.norm_f = LayerNorm(hidden, config.layer_norm_epsilon, bias=not config.no_bias)
        drop_other_stages(self, first=("wte",), last=("norm_f",))

    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate: tuple | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """hidden [num_tokens, hidden]; a stage before the last returns (x, residual) (models/stages.py)."""
        x, residual = (self.wte(input_ids), None) if intermediate is None else intermediate  # [num_tokens, hidden]
        for i in range(self.first, self.last):
            x, residual = self.blocks[i](x, residual)
        return self.norm_f(x, residual)[0] if self.is_last_stage else to_next_stage(x, residual)


class MPTForCausalLM(CausalLM):
    model_cls = MPTModel
    model_attr, embedding_attr = "transformer", "wte"
    tie_default, model_takes_max_position = True, False
    supports_tensor_parallel = supports_pipeline_parallel = True
    stacked = []  # ffn.up_proj is no shard
