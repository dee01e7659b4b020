"""StarCoder2: the Llama layout with LayerNorm (with bias), a plain GELU MLP (c_fc/c_proj), biases on every
projection (use_bias) and an optional sliding window."""

from __future__ import annotations

from torch import nn

from pagedllm.layers.layernorm import LayerNorm
from pagedllm.layers.mlp import PlainMLP
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Starcoder2Attention(LlamaAttention):
    @staticmethod
    def biases(config) -> tuple[bool, bool]:
        return bool(config.use_bias), bool(config.use_bias)


class Starcoder2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Starcoder2Attention
    norm_cls = LayerNorm

    @staticmethod
    def make_mlp(config, quant_config: QuantizationConfig | None, prefix: str) -> nn.Module:
        hidden, inner, bias = config.hidden_size, config.intermediate_size, bool(config.use_bias)
        return PlainMLP(hidden, inner, bias, config.hidden_act, quant_config, prefix, ("c_fc", "c_proj"))


class Starcoder2Model(LlamaModel):
    layer_cls = Starcoder2DecoderLayer
    norm_cls = LayerNorm


class Starcoder2ForCausalLM(LlamaForCausalLM):
    model_cls = Starcoder2Model
