"""Decoder embedders shipped as bare models (e5-mistral's MistralModel, gte-Qwen2's Qwen2Model): the decoder stack
and final norm without an LM head, weights saved without the `model.` prefix. They only pool (last token)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.models.llama import LlamaModel
from pagedllm.models.qwen2 import Qwen2Model
from pagedllm.models.qwen3 import Qwen3Model
from pagedllm.models.utils import load_weights


def _strip_model_prefix(hf_name: str) -> str:
    return hf_name[len("model.") :] if hf_name.startswith("model.") else hf_name  # a checkpoint saved with it


class _BareDecoder:
    """Mixin over a decoder stack: the HF config kept, weights loaded without the task model's prefix. Causal
    attention unless the config says `is_causal: false` (vLLM's switch for bidirectional embedders such as
    gte-Qwen2-1.5B, e.g. through hf_overrides). Split over ranks as the decoder is (tensor and pipeline
    parallelism: the pooling runner passes the stages' hidden states on)."""

    supports_tensor_parallel = True
    supports_pipeline_parallel = True

    def __init__(
        self, config, quant_config: QuantizationConfig | None = None, prefix: str = "", *, max_position: int
    ) -> None:
        super().__init__(config, quant_config, prefix, max_position=max_position)
        self.config = config
        self.is_causal = bool(getattr(config, "is_causal", True))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_weights(self, weights, rename=_strip_model_prefix, ignore=("rotary_emb.inv_freq", "lm_head."))


class LlamaEmbeddingModel(_BareDecoder, LlamaModel):
    """LlamaModel and MistralModel checkpoints (Mistral's sliding window comes from the config)."""


class Qwen2EmbeddingModel(_BareDecoder, Qwen2Model):
    """Qwen2Model checkpoints (gte-Qwen2)."""


class Qwen3EmbeddingModel(_BareDecoder, Qwen3Model):
    """Qwen3Model checkpoints (Qwen3-Embedding)."""
