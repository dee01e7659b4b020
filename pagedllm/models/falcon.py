"""Falcon: rotary (or ALiBi with config.alibi), fused q/k/v in one of three layouts (new_decoder_architecture:
per KV group [q..., k, v]; multi_query: [q, k, v] with one KV head; else per head [q, k, v]), and attention and
MLP in parallel from one or two LayerNorms (or in sequence, parallel_attn=False)."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.attention import Attention, alibi_slopes
from pagedllm.layers.layernorm import LayerNorm
from pagedllm.layers.linear import QKVParallelLinear, RowParallelLinear
from pagedllm.layers.mlp import PlainMLP
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.layers.rotary_embedding import RotaryEmbedding, apply_qk_rotary, rope_parameters
from pagedllm.layers.vocab_embedding import VocabParallelEmbedding
from pagedllm.models.causal_lm import CausalLM
from pagedllm.models.stages import build_stage, drop_other_stages, stream_of, to_next_stage
from pagedllm.models.utils import join_prefix, num_kv_heads_of, rank_alibi_slopes, regroup_per_head_qkv


class FalconAttention(nn.Module):
    def __init__(self, config, quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        hidden, total_heads = config.hidden_size, config.num_attention_heads
        self.head_dim = hidden // total_heads
        qkv = self.query_key_value = QKVParallelLinear(
            hidden, self.head_dim, total_heads, num_kv_heads_of(config), config.bias, quant_config,
            join_prefix(prefix, "query_key_value"),
        )  # fmt: skip
        # this rank's heads (a multi-query model's one KV head on every rank)
        self.num_heads, self.num_kv_heads = qkv.num_heads, qkv.num_kv_heads
        self.q_size, self.kv_size = qkv.q_size, qkv.kv_size
        self.dense = RowParallelLinear(hidden, hidden, config.bias, quant_config, join_prefix(prefix, "dense"))
        scale = self.head_dim**-0.5
        self.use_rotary = not config.alibi
        slopes = None if self.use_rotary else rank_alibi_slopes(alibi_slopes(total_heads), qkv) * scale  # as HF
        self.attn = Attention(self.num_heads, self.head_dim, scale, self.num_kv_heads, alibi_slopes=slopes)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor] | None, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.query_key_value(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.use_rotary:
            q = q.view(n, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
            k = k.view(n, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
            q, k = apply_qk_rotary(q, k, rope)
            q, k = q.reshape(n, -1), k.reshape(n, -1)
        return self.dense(self.attn(q, k, v))


class FalconDecoderLayer(nn.Module):
    def __init__(self, config, quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        self.new_arch, self.parallel = config.new_decoder_architecture, config.parallel_attn
        num_ln = config.num_ln_in_parallel_attn or (2 if self.new_arch else 1)
        self.two_norms = self.new_arch and num_ln == 2
        if self.two_norms:
            self.ln_attn, self.ln_mlp = LayerNorm(hidden, eps), LayerNorm(hidden, eps)
        else:
            self.input_layernorm = LayerNorm(hidden, eps)
        if not self.parallel and not self.new_arch:
            self.post_attention_layernorm = LayerNorm(hidden, eps)
        self.self_attention = FalconAttention(config, quant_config, join_prefix(prefix, "self_attention"))
        ffn, names = config.ffn_hidden_size, ("dense_h_to_4h", "dense_4h_to_h")
        self.mlp = PlainMLP(
            hidden, ffn, config.bias, config.activation, quant_config, join_prefix(prefix, "mlp"), names
        )

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor] | None, x: torch.Tensor) -> torch.Tensor:
        if self.two_norms:
            attn_in, mlp_in = self.ln_attn(x), self.ln_mlp(x)
        else:
            attn_in = mlp_in = self.input_layernorm(x)
        attn = self.self_attention(rope, attn_in)
        if not self.new_arch and not self.parallel:  # sequential: attention's residual first
            x = x + attn
            return x + self.mlp(self.post_attention_layernorm(x))
        return x + attn + self.mlp(mlp_in)


class FalconModel(nn.Module):
    def __init__(
        self, config, quant_config: QuantizationConfig | None = None, prefix: str = "", *, max_position: int
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, hidden)
        self.h = build_stage(
            self, config.num_hidden_layers,
            lambda i: FalconDecoderLayer(config, quant_config, join_prefix(prefix, f"h.{i}")),
        )  # fmt: skip
        self.ln_f = LayerNorm(hidden, config.layer_norm_epsilon)
        self.rotary_emb = None
        if not config.alibi:
            head_dim = hidden // config.num_attention_heads
            self.rotary_emb = RotaryEmbedding(head_dim, max_position, *rope_parameters(config))
        drop_other_stages(self, first=("word_embeddings",), last=("ln_f",))

    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate: tuple | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """hidden [num_tokens, hidden]; a stage before the last returns (stream, zeros) (models/stages.py)."""
        x = self.word_embeddings(input_ids) if intermediate is None else stream_of(intermediate)  # [num_tokens, hidden]
        rope = self.rotary_emb(positions, x.dtype) if self.rotary_emb is not None else None
        for i in range(self.first, self.last):
            x = self.h[i](rope, x)
        return self.ln_f(x) if self.is_last_stage else to_next_stage(x)


class FalconForCausalLM(CausalLM):
    model_cls = FalconModel
    model_attr, embedding_attr = "transformer", "word_embeddings"
    tie_default = True
    supports_tensor_parallel = supports_pipeline_parallel = True

    def convert(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Regroups the fused q/k/v rows to [q, k, v] (multi-query checkpoints have them so already)."""
        if ".query_key_value." not in name:
            return tensor
        config, rest = self.config, tensor.shape[1:]
        num_heads = config.num_attention_heads
        if config.new_decoder_architecture:  # [(kv_head, (q x group, k, v), head_dim)]
            num_kv = config.num_kv_heads
            grouped = tensor.reshape(num_kv, num_heads // num_kv + 2, -1, *rest)
            q, k, v = grouped[:, :-2], grouped[:, -2], grouped[:, -1]
            tensor = torch.cat([q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)])
        elif not config.multi_query:  # [(head, (q, k, v), head_dim)]
            tensor = regroup_per_head_qkv(tensor, num_heads)
        return tensor
