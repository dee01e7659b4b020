"""Multimodal inputs (images): processing with the model's transformers processor, per-item hashes, and the
runner-side encoder cache that merges encoder outputs into the input embeddings."""

from pagedllm.multimodal.config import MULTIMODAL_ARCHITECTURES, MultiModalConfig
from pagedllm.multimodal.inputs import MultiModalFeature

__all__ = ["MULTIMODAL_ARCHITECTURES", "MultiModalConfig", "MultiModalFeature"]
