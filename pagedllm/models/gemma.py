"""Gemma: the Llama architecture with RMSNorm scaling by (1 + weight), a gated GELU (tanh) MLP, the embedding
scaled by sqrt(hidden_size) and the LM head tied to it."""

from __future__ import annotations

import torch

from pagedllm.layers.layernorm import GemmaRMSNorm
from pagedllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class GemmaAttention(LlamaAttention):
    norm_cls = GemmaRMSNorm


class GemmaDecoderLayer(LlamaDecoderLayer):
    attention_cls = GemmaAttention
    norm_cls = GemmaRMSNorm


class GemmaModel(LlamaModel):
    layer_cls = GemmaDecoderLayer
    norm_cls = GemmaRMSNorm

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        """Token rows times sqrt(hidden), as HF's scaled embedding module rounds it. HF's inputs_embeds (what
        get_input_embeddings() gives: prompt embeddings) are already scaled, so embed_inputs keeps them as they are."""
        embeds = self.embed_tokens(input_ids)
        return embeds * torch.tensor(self.embed_tokens.weight.shape[1] ** 0.5, dtype=embeds.dtype)


class GemmaForCausalLM(LlamaForCausalLM):
    model_cls = GemmaModel
