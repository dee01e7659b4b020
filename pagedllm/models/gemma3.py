"""Gemma 3 (text): Gemma 2's layers with RMSNorm on each head of q and k before rotary, and separate rotary bases
for sliding-window (local) and full-attention (global) layers (config.rope_parameters keyed by layer type).
Gemma 3 multimodal checkpoints (Gemma3ForConditionalGeneration) run as text models: their language model only."""

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
        super().__init__(config, quant_config, prefix, max_position=max_position)
        local = _rope_for(config, "sliding_attention", "rope_local_base_freq")
        self.rotary_emb_local = RotaryEmbedding(head_dim_of(config), max_position, *local)

    def make_rotary(self, config, max_position: int) -> RotaryEmbedding:
        return RotaryEmbedding(head_dim_of(config), max_position, *_rope_for(config, "full_attention", ""))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed(input_ids), None  # [num_tokens, hidden]
        rope_global = self.rotary_emb(positions, x.dtype)
        rope_local = self.rotary_emb_local(positions, x.dtype)
        for layer in self.layers:
            x, residual = layer(rope_local if layer.is_sliding else rope_global, x, residual)
        x, _ = self.norm(x, residual)
        return x


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    model_cls = Gemma3Model
    supports_pipeline_parallel = False  # its decoder's forward (two rope tables) is not split into stages yet


# the language model's prefix in Gemma3ForConditionalGeneration checkpoints -> Gemma3ForCausalLM's
_TEXT_PREFIXES = (
    ("model.language_model.", "model."),  # transformers >= 4.52
    ("language_model.model.", "model."),  # earlier checkpoints
    ("language_model.lm_head.", "lm_head."),
)
_VISION_PARTS = ("vision_tower.", "multi_modal_projector.")  # skipped: images are not supported yet


def _text_name(name: str) -> str:
    for theirs, ours in _TEXT_PREFIXES:
        if name.startswith(theirs):
            return ours + name[len(theirs) :]
    return name


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """A Gemma 3 image-text checkpoint as a text model: built from its text_config (the loader hands over
    `config.text_config`), its language model's weights loaded, the vision tower and projector skipped."""

    rename = staticmethod(_text_name)
    extra_ignore = _VISION_PARTS
