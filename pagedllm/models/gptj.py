"""GPT-J: one LayerNorm feeding attention and a GELU MLP in parallel, rotary in the interleaved (every-two) layout
over the first rotary_dim dims of each head, no bias on q/k/v/out, and an LM head with a bias."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.attention import Attention
from pagedllm.layers.layernorm import LayerNorm
from pagedllm.layers.linear import QKVParallelLinear, RowParallelLinear
from pagedllm.layers.mlp import PlainMLP
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.layers.rotary_embedding import RotaryEmbedding, apply_partial_rotary
from pagedllm.layers.vocab_embedding import VocabParallelEmbedding
from pagedllm.models.causal_lm import CausalLM
from pagedllm.models.phi import BiasedLMHead
from pagedllm.models.stages import build_stage, drop_other_stages, stream_of, to_next_stage
from pagedllm.models.utils import join_prefix


def rotary_dim_of(config) -> int:
    return config.rotary_dim or config.hidden_size // config.num_attention_heads


class GPTJAttention(nn.Module):
    def __init__(self, config, quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        hidden, total_heads = config.hidden_size, config.num_attention_heads
        self.head_dim = hidden // total_heads
        self.rot_dim = rotary_dim_of(config)
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_dim, total_heads, total_heads, False, quant_config, join_prefix(prefix, "qkv_proj")
        )
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.out_proj = RowParallelLinear(hidden, hidden, False, quant_config, join_prefix(prefix, "out_proj"))
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_heads)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        q, k = apply_partial_rotary(
            q.view(n, self.num_heads, self.head_dim), k.view(n, self.num_heads, self.head_dim), rope, self.rot_dim, True
        )
        return self.out_proj(self.attn(q.reshape(n, -1), k.reshape(n, -1), v))


class GPTJBlock(nn.Module):
    def __init__(self, config, quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        hidden = config.hidden_size
        self.ln_1 = LayerNorm(hidden, config.layer_norm_epsilon)
        self.attn = GPTJAttention(config, quant_config, join_prefix(prefix, "attn"))
        inner, act = config.n_inner or 4 * hidden, config.activation_function
        self.mlp = PlainMLP(hidden, inner, True, act, quant_config, join_prefix(prefix, "mlp"), ("fc_in", "fc_out"))

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        return x + self.attn(rope, h) + self.mlp(h)


class GPTJModel(nn.Module):
    def __init__(
        self, config, quant_config: QuantizationConfig | None = None, prefix: str = "", *, max_position: int
    ) -> None:
        super().__init__()
        self.wte = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.h = build_stage(
            self, config.num_hidden_layers, lambda i: GPTJBlock(config, quant_config, join_prefix(prefix, f"h.{i}"))
        )
        self.ln_f = LayerNorm(config.hidden_size, config.layer_norm_epsilon)
        self.rotary_emb = RotaryEmbedding(rotary_dim_of(config), max_position, 10000.0, None)
        drop_other_stages(self, first=("wte",), last=("ln_f",))

    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate: tuple | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """hidden [num_tokens, hidden]; a stage before the last returns (stream, zeros) (models/stages.py)."""
        x = self.wte(input_ids) if intermediate is None else stream_of(intermediate)  # [num_tokens, hidden]
        rope = self.rotary_emb(positions, x.dtype)
        for i in range(self.first, self.last):
            x = self.h[i](rope, x)
        return self.ln_f(x) if self.is_last_stage else to_next_stage(x)


class GPTJForCausalLM(CausalLM):
    model_cls = GPTJModel
    model_attr, embedding_attr = "transformer", "wte"
    head_cls, tied_head_ignore = BiasedLMHead, "lm_head.weight"
    extra_ignore = (".attn.bias", ".attn.masked_bias")  # mask buffers
    supports_tensor_parallel = supports_pipeline_parallel = True
