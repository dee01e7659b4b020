"""Phi-1/1.5/2: one LayerNorm feeding attention and a GELU MLP in parallel (x + attn(ln(x)) + mlp(ln(x))),
rotary over the first partial_rotary_factor of each head, optional per-head LayerNorm of q and k, and an LM head
with a bias."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.attention import Attention
from pagedllm.layers.layernorm import LayerNorm
from pagedllm.layers.linear import QKVParallelLinear, RowParallelLinear
from pagedllm.layers.mlp import PlainMLP
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.layers.rotary_embedding import RotaryEmbedding, apply_partial_rotary, partial_rotary_dim, rope_parameters
from pagedllm.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.models.causal_lm import CausalLM
from pagedllm.models.stages import build_stage, drop_other_stages, stream_of, to_next_stage
from pagedllm.models.utils import head_dim_of, join_prefix, num_kv_heads_of


class PhiAttention(nn.Module):
    def __init__(self, config, quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        hidden, total_heads, self.head_dim = config.hidden_size, config.num_attention_heads, head_dim_of(config)
        self.rot_dim = partial_rotary_dim(config, self.head_dim)
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_dim, total_heads, num_kv_heads_of(config), True, quant_config,
            join_prefix(prefix, "qkv_proj"),
        )  # fmt: skip
        # this rank's heads (all of them with one rank)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        o_size = total_heads * self.head_dim
        self.dense = RowParallelLinear(o_size, hidden, True, quant_config, join_prefix(prefix, "dense"))
        self.qk_layernorm = bool(getattr(config, "qk_layernorm", False))
        if self.qk_layernorm:
            self.q_layernorm = LayerNorm(self.head_dim, config.layer_norm_eps)
            self.k_layernorm = LayerNorm(self.head_dim, config.layer_norm_eps)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(n, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        if self.qk_layernorm:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q, k = apply_partial_rotary(q, k, rope, self.rot_dim)
        return self.dense(self.attn(q.reshape(n, -1), k.reshape(n, -1), v))


class PhiDecoderLayer(nn.Module):
    def __init__(self, config, quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.input_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.self_attn = PhiAttention(config, quant_config, join_prefix(prefix, "self_attn"))
        self.mlp = PlainMLP(
            config.hidden_size, config.intermediate_size, True, config.hidden_act, quant_config,
            join_prefix(prefix, "mlp"),
        )  # fmt: skip

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x)
        return x + self.self_attn(rope, h) + self.mlp(h)


class PhiModel(nn.Module):
    def __init__(
        self, config, quant_config: QuantizationConfig | None = None, prefix: str = "", *, max_position: int
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = build_stage(
            self, config.num_hidden_layers,
            lambda i: PhiDecoderLayer(config, quant_config, join_prefix(prefix, f"layers.{i}")),
        )  # fmt: skip
        self.final_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps)
        rot_dim = partial_rotary_dim(config, head_dim_of(config))
        self.rotary_emb = RotaryEmbedding(rot_dim, max_position, *rope_parameters(config))
        drop_other_stages(self, first=("embed_tokens",), last=("final_layernorm",))

    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate: tuple | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """hidden [num_tokens, hidden]; a stage before the last returns (stream, zeros) (models/stages.py)."""
        x = self.embed_tokens(input_ids) if intermediate is None else stream_of(intermediate)  # [num_tokens, hidden]
        rope = self.rotary_emb(positions, x.dtype)
        for i in range(self.first, self.last):
            x = self.layers[i](rope, x)
        return self.final_layernorm(x) if self.is_last_stage else to_next_stage(x)


class BiasedLMHead(ParallelLMHead):
    """The LM head with a bias over the vocabulary (whole on every rank: added to the gathered logits)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(vocab_size, hidden_size)
        self.bias = nn.Parameter(torch.empty(vocab_size), requires_grad=False)  # [vocab]

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        logits = super().compute_logits(hidden, upcast)  # [n, vocab]
        return logits + (self.bias.float() if upcast else self.bias)


class PhiForCausalLM(CausalLM):
    model_cls = PhiModel
    head_cls, tied_head_ignore = BiasedLMHead, "lm_head.weight"
    supports_tensor_parallel = supports_pipeline_parallel = True
