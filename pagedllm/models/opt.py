"""OPT: learned positions (offset 2), LayerNorm before (or after) each block, ReLU MLP (fc1/fc2), and a projection
in and out of the embedding width when word_embed_proj_dim differs from hidden_size."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.attention import Attention
from pagedllm.layers.layernorm import LayerNorm
from pagedllm.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from pagedllm.layers.mlp import PlainMLP
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.layers.vocab_embedding import LearnedPositionEmbedding, VocabParallelEmbedding
from pagedllm.models.causal_lm import CausalLM
from pagedllm.models.stages import build_stage, drop_other_stages, stream_of, to_next_stage
from pagedllm.models.utils import join_prefix


class OPTAttention(nn.Module):
    def __init__(self, config, quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        hidden, total_heads = config.hidden_size, config.num_attention_heads
        head_dim = hidden // total_heads
        bias = getattr(config, "enable_bias", True)
        self.qkv_proj = QKVParallelLinear(
            hidden, head_dim, total_heads, total_heads, bias, quant_config, join_prefix(prefix, "qkv_proj")
        )
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.out_proj = RowParallelLinear(hidden, hidden, bias, quant_config, join_prefix(prefix, "out_proj"))
        self.attn = Attention(self.num_heads, head_dim, head_dim**-0.5, self.num_heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)  # each [num_tokens, num_heads * head_dim] of this rank
        return self.out_proj(self.attn(q, k, v))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config, quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        hidden = config.hidden_size
        self.pre_norm = config.do_layer_norm_before
        affine = getattr(config, "layer_norm_elementwise_affine", True)
        self.self_attn = OPTAttention(config, quant_config, join_prefix(prefix, "self_attn"))
        self.self_attn_layer_norm = LayerNorm(hidden, affine=affine)
        bias = getattr(config, "enable_bias", True)
        self.mlp = PlainMLP(hidden, config.ffn_dim, bias, config.activation_function, quant_config, prefix)
        self.final_layer_norm = LayerNorm(hidden, affine=affine)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = x
        h = self.self_attn(self.self_attn_layer_norm(x) if self.pre_norm else x)
        x = residual + h
        if not self.pre_norm:
            x = self.self_attn_layer_norm(x)
        h = self.mlp(self.final_layer_norm(x) if self.pre_norm else x)
        x = x + h
        return x if self.pre_norm else self.final_layer_norm(x)


class OPTDecoder(nn.Module):
    def __init__(self, config, quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        hidden, embed_dim = config.hidden_size, config.word_embed_proj_dim
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, embed_dim)
        self.embed_positions = LearnedPositionEmbedding(config.max_position_embeddings, hidden, offset=2)
        self.project_in = self.project_out = None
        if embed_dim != hidden:
            # small: whole on every rank
            self.project_in = ReplicatedLinear(embed_dim, hidden, False, None, join_prefix(prefix, "project_in"))
            self.project_out = ReplicatedLinear(hidden, embed_dim, False, None, join_prefix(prefix, "project_out"))
        self.final_layer_norm = None
        if config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False):
            self.final_layer_norm = LayerNorm(hidden, affine=getattr(config, "layer_norm_elementwise_affine", True))
        self.layers = build_stage(
            self, config.num_hidden_layers,
            lambda i: OPTDecoderLayer(config, quant_config, join_prefix(prefix, f"layers.{i}")),
        )  # fmt: skip
        first, last = ("embed_tokens", "embed_positions", "project_in"), ("final_layer_norm", "project_out")
        drop_other_stages(self, first, last)

    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate: tuple | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """hidden [num_tokens, word_embed_proj_dim]; a stage before the last returns (stream, zeros) [num_tokens,
        hidden] (models/stages.py)."""
        if intermediate is None:
            x = self.embed_tokens(input_ids)  # [num_tokens, word_embed_proj_dim]
            if self.project_in is not None:
                x = self.project_in(x)
            x = x + self.embed_positions(positions)  # [num_tokens, hidden]
        else:
            x = stream_of(intermediate)
        for i in range(self.first, self.last):
            x = self.layers[i](x)
        if not self.is_last_stage:
            return to_next_stage(x)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        return self.project_out(x) if self.project_out is not None else x


class OPTModel(nn.Module):
    def __init__(self, config, quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.decoder = OPTDecoder(config, quant_config, join_prefix(prefix, "decoder"))

    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate: tuple | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.decoder(input_ids, positions, intermediate)


class OPTForCausalLM(CausalLM):
    model_cls = OPTModel
    embedding_attr = "decoder.embed_tokens"
    tie_default, model_takes_max_position, learned_positions = True, False, True
    supports_tensor_parallel = supports_pipeline_parallel = True

    @staticmethod
    def head_size(config) -> int:
        return config.word_embed_proj_dim

    @staticmethod
    def rename(name: str) -> str:
        """Checkpoints saved from OPTModel name the decoder without the `model.` prefix (facebook/opt-*); the MLP's
        fc1/fc2 live in its `mlp` here."""
        if name.startswith("decoder."):
            name = "model." + name
        return name.replace(".fc1.", ".mlp.fc1.").replace(".fc2.", ".mlp.fc2.")
