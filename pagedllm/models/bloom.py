"""BLOOM: ALiBi instead of positions, a LayerNorm right after the embedding, q/k/v fused per head in the checkpoint
([head, (q, k, v), head_dim] rows: regrouped on load), a GELU (tanh) MLP and, optionally, the residual taken after
each block's LayerNorm (apply_residual_connection_post_layernorm)."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.attention import Attention, alibi_slopes
from pagedllm.layers.layernorm import LayerNorm
from pagedllm.layers.linear import QKVParallelLinear, RowParallelLinear
from pagedllm.layers.mlp import PlainMLP
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.layers.vocab_embedding import VocabParallelEmbedding
from pagedllm.models.causal_lm import CausalLM
from pagedllm.models.stages import build_stage, drop_other_stages, stream_of, to_next_stage
from pagedllm.models.utils import join_prefix, rank_alibi_slopes, regroup_per_head_qkv


class BloomAttention(nn.Module):
    def __init__(self, config, quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        hidden, num_heads = config.hidden_size, config.num_attention_heads
        head_dim = hidden // num_heads
        self.query_key_value = QKVParallelLinear(
            hidden, head_dim, num_heads, num_heads, True, quant_config, join_prefix(prefix, "query_key_value")
        )
        self.dense = RowParallelLinear(hidden, hidden, True, quant_config, join_prefix(prefix, "dense"))
        rank_heads, qkv = self.query_key_value.num_heads, self.query_key_value  # this rank's heads
        slopes = rank_alibi_slopes(alibi_slopes(num_heads), qkv)
        self.attn = Attention(rank_heads, head_dim, head_dim**-0.5, rank_heads, alibi_slopes=slopes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.query_key_value(x).chunk(3, dim=-1)
        return self.dense(self.attn(q, k, v))


class BloomBlock(nn.Module):
    def __init__(self, config, quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        self.residual_after_norm = config.apply_residual_connection_post_layernorm
        self.input_layernorm = LayerNorm(hidden, eps)
        self.self_attention = BloomAttention(config, quant_config, join_prefix(prefix, "self_attention"))
        self.post_attention_layernorm = LayerNorm(hidden, eps)
        names = ("dense_h_to_4h", "dense_4h_to_h")
        self.mlp = PlainMLP(hidden, 4 * hidden, True, "gelu_new", quant_config, join_prefix(prefix, "mlp"), names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x)
        x = self.self_attention(h) + (h if self.residual_after_norm else x)
        h = self.post_attention_layernorm(x)
        return self.mlp(h) + (h if self.residual_after_norm else x)


class BloomModel(nn.Module):
    def __init__(self, config, quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, hidden)
        self.word_embeddings_layernorm = LayerNorm(hidden, eps)
        self.h = build_stage(
            self, config.num_hidden_layers, lambda i: BloomBlock(config, quant_config, join_prefix(prefix, f"h.{i}"))
        )
        self.ln_f = LayerNorm(hidden, eps)
        drop_other_stages(self, first=("word_embeddings", "word_embeddings_layernorm"), last=("ln_f",))

    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate: tuple | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """hidden [num_tokens, hidden]; a stage before the last returns (stream, zeros) (models/stages.py)."""
        if intermediate is None:
            x = self.word_embeddings_layernorm(self.word_embeddings(input_ids))  # [num_tokens, hidden]
        else:
            x = stream_of(intermediate)
        for i in range(self.first, self.last):
            x = self.h[i](x)
        return self.ln_f(x) if self.is_last_stage else to_next_stage(x)


class BloomForCausalLM(CausalLM):
    model_cls = BloomModel
    model_attr, embedding_attr = "transformer", "word_embeddings"
    tie_default, model_takes_max_position = True, False
    supports_tensor_parallel = supports_pipeline_parallel = True

    @staticmethod
    def rename(name: str) -> str:
        """Checkpoints saved from BloomModel lack the `transformer.` prefix."""
        return name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name

    def convert(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if ".query_key_value." in name:
            return regroup_per_head_qkv(tensor, self.config.num_attention_heads)
        return tensor
