"""Gemma 3 (text): Gemma 2's layers with RMSNorm on each head of q and k before rotary, and separate rotary bases
for sliding-window (local) and full-attention (global) layers (config.rope_parameters keyed by layer type).
The image-text model (Gemma3ForConditionalGeneration) is in gemma3_mm.py.

The decoder runs LlamaModel's forward (pipeline stages included): its rotary module gives both tables, (global,
local), and each layer takes its own."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

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

    def forward(
        self, ropes: tuple[tuple[torch.Tensor, torch.Tensor], ...], x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ropes: (global, local) cos/sin tables (LocalGlobalRotary); a sliding-window layer takes the local one."""
        return super().forward(ropes[self.is_sliding], x, residual)


def _rope_for(config, layer_type: str, legacy_theta: str) -> tuple[float, dict | None]:
    """(theta, scaling) of one layer type: transformers 5 keys rope_parameters by layer type; 4.x has rope_theta
    (global), rope_local_base_freq (local) and rope_scaling (global only)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and layer_type in params:
        return rope_parameters(SimpleNamespace(rope_parameters=params[layer_type]))
    if layer_type == "sliding_attention":
        return float(getattr(config, legacy_theta, 10000.0)), None
    return rope_parameters(config)


class LocalGlobalRotary(nn.Module):
    """The cos/sin tables of full-attention (global) and sliding-window (local) layers, looked up once per forward:
    (global, local), each as RotaryEmbedding gives it."""

    def __init__(self, config, max_position: int) -> None:
        super().__init__()
        head_dim = head_dim_of(config)
        self.global_rope = RotaryEmbedding(head_dim, max_position, *_rope_for(config, "full_attention", ""))
        local = _rope_for(config, "sliding_attention", "rope_local_base_freq")
        self.local_rope = RotaryEmbedding(head_dim, max_position, *local)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[tuple, tuple]:
        return self.global_rope(positions, dtype), self.local_rope(positions, dtype)


class Gemma3Model(Gemma2Model):
    layer_cls = Gemma3DecoderLayer

    def __init__(
        self, config, quant_config: QuantizationConfig | None = None, prefix: str = "", *, max_position: int
    ) -> None:
        if getattr(config, "use_bidirectional_attention", False):  # EmbeddingGemma: every token attends both ways
            raise ValueError("use_bidirectional_attention=True (EmbeddingGemma) is not supported; allowed: False")
        super().__init__(config, quant_config, prefix, max_position=max_position)

    def make_rotary(self, config, max_position: int) -> LocalGlobalRotary:
        return LocalGlobalRotary(config, max_position)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    model_cls = Gemma3Model
