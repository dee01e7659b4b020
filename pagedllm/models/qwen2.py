"""Qwen2: the Llama architecture with a bias on the Q/K/V projections (none on o_proj)."""

from __future__ import annotations

from pagedllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Qwen2Attention(LlamaAttention):
    @staticmethod
    def biases(config) -> tuple[bool, bool]:
        return True, False


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2Attention


class Qwen2Model(LlamaModel):
    layer_cls = Qwen2DecoderLayer


class Qwen2ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen2Model
