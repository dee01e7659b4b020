"""Qwen2.5-VL: Qwen2-VL's design (qwen2_vl.py) with the newer vision transformer (RMSNorm, gated MLPs, attention
within windows except in the full-attention blocks; see qwen2_vl_vision.py) and, for videos, temporal M-RoPE
positions spaced by the seconds each temporal patch covers (multimodal/mrope.py)."""

from __future__ import annotations

from pagedllm.models.qwen2_vl import Qwen2VLForConditionalGeneration


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """The checkpoint layout and the LM are Qwen2-VL's; the vision config picks the Qwen2.5 blocks."""
