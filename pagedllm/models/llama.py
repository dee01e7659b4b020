"""Llama (and the base of the Llama-like families): GQA attention with rotary, gated SiLU MLP, RMSNorm."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.activation import SiluAndMul, gated_activation
from pagedllm.layers.attention import Attention
from pagedllm.layers.build_context import current_build_context
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.layers.rotary_embedding import RotaryEmbedding, rope_parameters
from pagedllm.layers.vocab_embedding import VocabParallelEmbedding
from pagedllm.models.causal_lm import CausalLM
from pagedllm.models.stages import build_stage, drop_other_stages, to_next_stage
from pagedllm.models.utils import (
    head_dim_of,
    join_prefix,
    norm_eps_of,
    sliding_window_for_layer,
)


class LlamaMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        act: str = "silu",
    ) -> None:
        super().__init__()
        gate_up = [intermediate_size] * 2
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, gate_up, bias, quant_config, join_prefix(prefix, "gate_up_proj")
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias, quant_config, join_prefix(prefix, "down_proj")
        )
        self.act_fn = gated_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    qk_norm = False  # Qwen3 normalizes q and k per head
    norm_cls = RMSNorm

    def __init__(
        self, config, layer_idx: int, quant_config: QuantizationConfig | None = None, prefix: str = ""
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = head_dim_of(config)
        qkv_bias, o_bias = self.biases(config)
        self.qkv_proj = QKVParallelLinear(
            hidden,
            self.head_dim,
            total_heads,
            total_kv_heads,
            qkv_bias,
            quant_config,
            join_prefix(prefix, "qkv_proj"),
        )
        # this rank's heads (all of them with one rank)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        o_size = total_heads * self.head_dim
        self.o_proj = RowParallelLinear(o_size, hidden, o_bias, quant_config, join_prefix(prefix, "o_proj"))
        if self.qk_norm:
            self.q_norm = self.norm_cls(self.head_dim, norm_eps_of(config))
            self.k_norm = self.norm_cls(self.head_dim, norm_eps_of(config))
        self.attn = self.make_attention(config, layer_idx)

    def make_attention(self, config, layer_idx: int) -> Attention:
        window = sliding_window_for_layer(config, layer_idx)
        return Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, window)

    @staticmethod
    def biases(config) -> tuple[bool, bool]:
        """(bias on q/k/v, bias on o_proj)."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # rotary (after Qwen3's per-head norms) inside the attention layer: fused with the cache write when the
        # backend can
        norms = (self.q_norm, self.k_norm) if self.qk_norm else None
        return self.o_proj(self.attn(q, k, v, rope=rope, qk_norms=norms))


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention
    norm_cls = RMSNorm

    def __init__(
        self, config, layer_idx: int, quant_config: QuantizationConfig | None = None, prefix: str = ""
    ) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, layer_idx, quant_config, join_prefix(prefix, "self_attn"))
        self.mlp = self.make_mlp(config, quant_config, join_prefix(prefix, "mlp"))
        self.input_layernorm = self.norm_cls(config.hidden_size, norm_eps_of(config))
        self.post_attention_layernorm = self.norm_cls(config.hidden_size, norm_eps_of(config))
        if quant_config is not None:  # (unquantized layers never take fp8 input: no check a step)
            self.link_fp8_inputs()

    def link_fp8_inputs(self) -> None:
        """Where Llama's own forwards run, each norm and the SiLU-and-mul feed one linear layer: an FP8 layer with
        per-token activations takes its input quantized by their kernels (RMSNorm.fp8_output_for), not by a
        launch of its own. A family overriding the layer's, its attention's or its MLP's forward, or with another
        norm, keeps them plain."""
        attn, mlp = self.self_attn, self.mlp
        if not (
            type(self).forward is LlamaDecoderLayer.forward
            and type(attn).forward is LlamaAttention.forward
            and type(mlp).forward is LlamaMLP.forward
        ):
            return
        if _plain_norm(self.input_layernorm):
            self.input_layernorm.fp8_output_for = attn.qkv_proj.takes_fp8_input
        if _plain_norm(self.post_attention_layernorm):
            self.post_attention_layernorm.fp8_output_for = mlp.gate_up_proj.takes_fp8_input
        if type(mlp.act_fn) is SiluAndMul:
            mlp.act_fn.fp8_output_for = mlp.down_proj.takes_fp8_input

    @staticmethod
    def make_mlp(config, quant_config: QuantizationConfig | None, prefix: str) -> nn.Module:
        mlp_bias = getattr(config, "mlp_bias", False)
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        return LlamaMLP(config.hidden_size, config.intermediate_size, mlp_bias, quant_config, prefix, act)

    def forward(
        self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


def _plain_norm(norm: nn.Module) -> bool:
    return isinstance(norm, RMSNorm) and type(norm).forward is RMSNorm.forward


def _fusable(layer: nn.Module) -> bool:
    """A tensor-parallel decoder layer running Llama's forwards, whose row-parallel outputs go to RMSNorms."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    return (
        type(layer).forward is LlamaDecoderLayer.forward
        and type(attn).forward is LlamaAttention.forward
        and type(mlp).forward is LlamaMLP.forward
        and type(attn.o_proj) is RowParallelLinear
        and type(mlp.down_proj) is RowParallelLinear
        and attn.o_proj.tp_size > 1
        and _plain_norm(layer.input_layernorm)
        and _plain_norm(layer.post_attention_layernorm)
    )


class LlamaModel(nn.Module):
    """The decoder. With pipeline parallelism a stage builds only its layers (the others are placeholders without
    weights, so checkpoint names keep their indices); the first stage also holds the embedding, the last the final
    norm, and forward takes / returns the (hidden, residual) pair that crosses between stages."""

    layer_cls = LlamaDecoderLayer
    norm_cls = RMSNorm
    # an EAGLE-3 head sets these: the layers whose input (the residual stream) forward copies, concatenated, into
    # the buffer aux_hidden_states [max tokens, len(layers) * hidden] (a buffer: CUDA graphs replay the copy)
    aux_hidden_state_layers: tuple[int, ...] = ()
    aux_hidden_states: torch.Tensor | None = None

    def __init__(
        self, config, quant_config: QuantizationConfig | None = None, prefix: str = "", *, max_position: int
    ) -> None:
        super().__init__()
        context = current_build_context()
        if context.pp_size > 1 and type(self).forward is not LlamaModel.forward:
            raise ValueError(f"{type(self).__name__} does not support pipeline parallelism in pagedllm yet")
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = build_stage(
            self, config.num_hidden_layers,
            lambda i: self.layer_cls(config, i, quant_config, join_prefix(prefix, f"layers.{i}")),
        )  # fmt: skip
        self.rotary_emb = self.make_rotary(config, max_position)
        self.norm = self.norm_cls(config.hidden_size, norm_eps_of(config))
        drop_other_stages(self, first=("embed_tokens",), last=("norm",))
        self.defer_reductions()

    def defer_reductions(self) -> None:
        """With tensor parallelism, each decoder layer's o_proj and down_proj leave their all-reduce to the RMSNorm
        that takes their output next (post_attention_layernorm, the next layer's input_layernorm, the final norm),
        which sums it fused with its residual add: one kernel where there were two. Only where Llama's own forwards
        run between the two (a family overriding the model's, a layer's, its attention's or MLP's forward, or with
        another norm, keeps the plain all-reduce) and the output goes nowhere else: not from a stage's last layer to
        the next stage, not into a layer whose input EAGLE-3 copies (aux_hidden_state_layers; called again when
        those are set)."""
        if type(self).forward is not LlamaModel.forward:
            return
        fusable = {i: _fusable(self.layers[i]) for i in range(self.first, self.last)}
        for i in range(self.first, self.last):
            if not fusable[i]:
                continue
            layer = self.layers[i]
            group = layer.self_attn.o_proj.tp_group
            layer.self_attn.o_proj.reduce_results = False
            layer.post_attention_layernorm.reduce_group = group
            if i + 1 < self.last:
                defer = fusable[i + 1] and i + 1 not in self.aux_hidden_state_layers
                consumer = self.layers[i + 1].input_layernorm
            else:
                defer, consumer = self.is_last_stage and _plain_norm(self.norm), self.norm
            layer.mlp.down_proj.reduce_results = not defer
            if _plain_norm(consumer):
                consumer.reduce_group = group if defer else None

    def make_rotary(self, config, max_position: int) -> nn.Module:
        """The model's one cos/sin table module (a family with other rope dims or scaling overrides this)."""
        return RotaryEmbedding(head_dim_of(config), max_position, *rope_parameters(config))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_inputs(self.embed_tokens(input_ids))  # [num_tokens, hidden]

    def embed_inputs(self, embeds: torch.Tensor) -> torch.Tensor:
        """The decoder's input from rows of the input-embedding table (HF's `inputs_embeds`, what
        `get_input_embeddings()` gives): a family whose HF forward scales them (Granite) overrides this."""
        return embeds

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate: tuple | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """hidden [num_tokens, hidden]; a stage before the last returns (x, residual) for the next, which passes
        them as `intermediate` (its input_ids unused). inputs_embeds: the input embeddings when the caller made them
        (a vision-language model's, with image features in them), else embedded from input_ids."""
        if intermediate is not None:
            x, residual = intermediate
        else:
            x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds  # [num_tokens, hidden]
            residual = None
        rope = self.rotary_emb(positions, x.dtype)
        for i in range(self.first, self.last):
            if i in self.aux_hidden_state_layers:  # (its slot of the buffer: a stage holds some of the layers)
                j, h = self.aux_hidden_state_layers.index(i), x.shape[-1]
                self.aux_hidden_states[: x.shape[0], j * h : (j + 1) * h].copy_(x if residual is None else x + residual)
            x, residual = self.layers[i](rope, x, residual)
        if not self.is_last_stage:
            return to_next_stage(x, residual)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]


class LlamaForCausalLM(CausalLM):
    model_cls = LlamaModel
    supports_tensor_parallel = True
    supports_pipeline_parallel = True  # (LlamaModel refuses a subclass that overrides its forward)
