"""GPT-2: learned positions, pre-LayerNorm blocks, fused q/k/v (c_attn), gelu_new MLP (c_fc/c_proj). The
checkpoint's Conv1D weights are stored [in, out]: transposed on load."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.attention import Attention
from pagedllm.layers.layernorm import LayerNorm
from pagedllm.layers.linear import QKVParallelLinear, RowParallelLinear
from pagedllm.layers.mlp import PlainMLP
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.layers.vocab_embedding import LearnedPositionEmbedding, VocabParallelEmbedding
from pagedllm.models.causal_lm import CausalLM
from pagedllm.models.stages import build_stage, drop_other_stages, to_next_stage
from pagedllm.models.utils import join_prefix

CONV1D = ("c_attn.weight", "c_proj.weight", "c_fc.weight")  # stored transposed


class GPT2Attention(nn.Module):
    def __init__(self, config, layer_idx: int, quant_config: QuantizationConfig | None = None, prefix: str = ""):
        super().__init__()
        hidden, num_heads = config.hidden_size, config.num_attention_heads
        head_dim = hidden // num_heads
        self.c_attn = QKVParallelLinear(
            hidden, head_dim, num_heads, num_heads, True, quant_config, join_prefix(prefix, "c_attn")
        )
        self.c_proj = RowParallelLinear(hidden, hidden, True, quant_config, join_prefix(prefix, "c_proj"))
        scale = head_dim**-0.5 if getattr(config, "scale_attn_weights", True) else 1.0
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            scale /= layer_idx + 1
        rank_heads = self.c_attn.num_heads  # this rank's
        self.attn = Attention(rank_heads, head_dim, scale, rank_heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).chunk(3, dim=-1)  # each [num_tokens, num_heads * head_dim] of this rank
        return self.c_proj(self.attn(q, k, v))


class GPT2Block(nn.Module):
    attention_cls = GPT2Attention

    def __init__(self, config, layer_idx: int, quant_config: QuantizationConfig | None = None, prefix: str = ""):
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        inner = getattr(config, "n_inner", None) or 4 * hidden
        self.ln_1 = LayerNorm(hidden, eps)
        self.attn = self.attention_cls(config, layer_idx, quant_config, join_prefix(prefix, "attn"))
        self.ln_2 = LayerNorm(hidden, eps)
        act, names = config.activation_function, ("c_fc", "c_proj")
        self.mlp = PlainMLP(hidden, inner, True, act, quant_config, join_prefix(prefix, "mlp"), names)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.ln_1(x)
        else:
            x, residual = self.ln_1(x, residual)
        x, residual = self.ln_2(self.attn(x), residual)
        return self.mlp(x), residual


class GPT2Model(nn.Module):
    block_cls = GPT2Block

    def __init__(self, config, quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.wte = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.wpe = LearnedPositionEmbedding(config.max_position_embeddings, config.hidden_size)
        self.h = build_stage(
            self,
            config.num_hidden_layers,
            lambda i: self.block_cls(config, i, quant_config, join_prefix(prefix, f"h.{i}")),
        )
        self.ln_f = LayerNorm(config.hidden_size, config.layer_norm_epsilon)
        drop_other_stages(self, first=("wte", "wpe"), last=("ln_f",))

    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate: tuple | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """hidden [num_tokens, hidden]; a stage before the last returns (x, residual) (models/stages.py)."""
        if intermediate is None:
            x, residual = self.wte(input_ids) + self.wpe(positions), None  # [num_tokens, hidden]
        else:
            x, residual = intermediate
        for i in range(self.first, self.last):
            x, residual = self.h[i](x, residual)
        if not self.is_last_stage:
            return to_next_stage(x, residual)
        return self.ln_f(x, residual)[0]


class GPT2LMHeadModel(CausalLM):
    model_cls = GPT2Model
    model_attr, embedding_attr = "transformer", "wte"
    tie_default, model_takes_max_position, learned_positions = True, False, True
    supports_tensor_parallel = supports_pipeline_parallel = True
    extra_ignore = (".attn.bias", ".attn.masked_bias")  # old checkpoints' mask buffers

    @staticmethod
    def rename(name: str) -> str:
        """Adds the `transformer.` prefix that checkpoints saved from GPT2Model lack."""
        return name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name

    def convert(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The Conv1D weights to [out, in]."""
        return tensor.t() if name.endswith(CONV1D) else tensor
