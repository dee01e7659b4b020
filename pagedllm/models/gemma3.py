"""Gemma 3 (text): Gemma 2's layers with RMSNorm on each head of q and k before rotary, and separate rotary bases
for sliding-window (local) and full-attention (global) layers (config.rope_parameters keyed by layer type).
The image-text model (Gemma3ForConditionalGeneration) is in gemma3_mm.py."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.layers.rotary_embedding import RotaryEmbedding, rope_parameters
from pagedllm.models.gemma2 import Gemma2Attention, Gemma2DecoderLayer, Gemma2ForCausalLM, Gemma2Model
from pagedllm.models.utils import head_dim_of, sliding_window_for_layer


class Gemma3Attention(Gemma2Attention):
    qk_norm = True


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_cls = Gemma3Attention

    def __init__(
        self, config, layer_idx: int, quant_config: QuantizationConfig | None = None, prefix: str = ""
    ) -> None:
        super().__init__(config, layer_idx, quant_config, prefix)
        self.is_sliding = sliding_window_for_layer(config, layer_idx) is not None


def _rope_for(config, layer_type: str, legacy_theta: str) -> tuple[float, dict | None]:
    """(theta, scaling) of one layer type: transformers 5 keys rope_parameters by layer type; 4.x has rope_theta
    (global), rope_local_base_freq (local) and rope_scaling (global only)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and layer_type in params:
        return rope_parameters(SimpleNamespace(rope_parameters=params[layer_type]))
    if layer_type == "sliding_attention":
        return float(getattr(config, legacy_theta, 10000.0)), None
    return rope_parameters(config)


class Gemma3Model(Gemma2Model):
    layer_cls = Gemma3DecoderLayer

    def __init__(
        self, config, quant_config: QuantizationConfig | None = None, prefix: str = "", *, max_position: int
    ) -> None:
        if getattr(config, "use_bidirectional_attention", False):  # EmbeddingGemma: every token attends both ways
            raise ValueError("use_bidirectional_attention=True (EmbeddingGemma) is not supported; allowed: False")
        super().__init__(config, quant_config, prefix, max_position=max_position)
        local = _rope_for(config, "sliding_attention", "rope_local_base_freq")
        self.rotary_emb_local = RotaryEmbedding(head_dim_of(config), max_position, *local)

    def make_rotary(self, config, max_position: int) -> RotaryEmbedding:
        return RotaryEmbedding(head_dim_of(config), max_position, *_rope_for(config, "full_attention", ""))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        """inputs_embeds: the input embeddings when the caller made them (with image features), else embedded."""
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds  # [num_tokens, hidden]
        residual = None
        rope_global = self.rotary_emb(positions, x.dtype)
        rope_local = self.rotary_emb_local(positions, x.dtype)
        for layer in self.layers:
            x, residual = layer(rope_local if layer.is_sliding else rope_global, x, residual)
        x, _ = self.norm(x, residual)
        return x


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    model_cls = Gemma3Model
    supports_pipeline_parallel = False  # its decoder's forward (two rope tables) is not split into stages yet
