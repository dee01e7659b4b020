"""GPT-NeoX (Pythia): rotary over the first rotary_pct of each head, LayerNorm, a parallel residual
(x + attn(ln1(x)) + mlp(ln2(x))) or a sequential one, and q/k/v fused per head in the checkpoint
([head, (q, k, v), head_dim] rows: regrouped to q, k, v on load)."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.attention import Attention
from pagedllm.layers.layernorm import LayerNorm
from pagedllm.layers.linear import QKVParallelLinear, RowParallelLinear
from pagedllm.layers.mlp import PlainMLP
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.layers.rotary_embedding import (
    RotaryEmbedding,
    apply_partial_rotary,
    partial_rotary_dim,
    rope_parameters,
)
from pagedllm.layers.vocab_embedding import VocabParallelEmbedding
from pagedllm.models.causal_lm import CausalLM
from pagedllm.models.stages import build_stage, drop_other_stages, stream_of, to_next_stage
from pagedllm.models.utils import join_prefix, regroup_per_head_qkv


class GPTNeoXAttention(nn.Module):
    def __init__(self, config, quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        hidden, total_heads = config.hidden_size, config.num_attention_heads
        self.head_dim = hidden // total_heads
        self.rot_dim = partial_rotary_dim(config, self.head_dim)
        bias = getattr(config, "attention_bias", True)
        self.query_key_value = QKVParallelLinear(
            hidden, self.head_dim, total_heads, total_heads, bias, quant_config,
            join_prefix(prefix, "query_key_value"),
        )  # fmt: skip
        self.num_heads = self.query_key_value.num_heads  # this rank's
        self.dense = RowParallelLinear(hidden, hidden, bias, quant_config, join_prefix(prefix, "dense"))
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_heads)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.query_key_value(x).chunk(3, dim=-1)
        q, k = apply_partial_rotary(
            q.view(n, self.num_heads, self.head_dim), k.view(n, self.num_heads, self.head_dim), rope, self.rot_dim
        )
        return self.dense(self.attn(q.reshape(n, -1), k.reshape(n, -1), v))


class GPTNeoXLayer(nn.Module):
    def __init__(self, config, quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_eps
        self.parallel = config.use_parallel_residual
        self.input_layernorm = LayerNorm(hidden, eps)
        self.post_attention_layernorm = LayerNorm(hidden, eps)
        self.attention = GPTNeoXAttention(config, quant_config, join_prefix(prefix, "attention"))
        self.mlp = PlainMLP(
            hidden, config.intermediate_size, True, config.hidden_act, quant_config, join_prefix(prefix, "mlp"),
            ("dense_h_to_4h", "dense_4h_to_h"),
        )  # fmt: skip

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        attn = self.attention(rope, self.input_layernorm(x))
        if self.parallel:
            return x + attn + self.mlp(self.post_attention_layernorm(x))
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class GPTNeoXModel(nn.Module):
    def __init__(
        self, config, quant_config: QuantizationConfig | None = None, prefix: str = "", *, max_position: int
    ) -> None:
        super().__init__()
        self.embed_in = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = build_stage(
            self, config.num_hidden_layers,
            lambda i: GPTNeoXLayer(config, quant_config, join_prefix(prefix, f"layers.{i}")),
        )  # fmt: skip
        self.final_layer_norm = LayerNorm(config.hidden_size, config.layer_norm_eps)
        rot_dim = partial_rotary_dim(config, config.hidden_size // config.num_attention_heads)
        self.rotary_emb = RotaryEmbedding(rot_dim, max_position, *rope_parameters(config))
        drop_other_stages(self, first=("embed_in",), last=("final_layer_norm",))

    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate: tuple | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """hidden [num_tokens, hidden]; a stage before the last returns (stream, zeros) (models/stages.py)."""
        x = self.embed_in(input_ids) if intermediate is None else stream_of(intermediate)  # [num_tokens, hidden]
        rope = self.rotary_emb(positions, x.dtype)
        for i in range(self.first, self.last):
            x = self.layers[i](rope, x)
        return self.final_layer_norm(x) if self.is_last_stage else to_next_stage(x)


class GPTNeoXForCausalLM(CausalLM):
    model_cls = GPTNeoXModel
    supports_tensor_parallel = supports_pipeline_parallel = True
    model_attr, embedding_attr, head_attr = "gpt_neox", "embed_in", "embed_out"
    extra_ignore = (".attention.bias", ".attention.masked_bias")  # mask buffers

    def convert(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if ".query_key_value." in name:
            return regroup_per_head_qkv(tensor, self.config.num_attention_heads)
        return tensor
