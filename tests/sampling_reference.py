"""Reference filters for the sampler tests: HF transformers' logits warpers in vLLM's order."""

from __future__ import annotations

import torch
from transformers import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper


def hf_kept(x: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0):
    """The tokens HF's warpers keep of logits x [vocab] after temperature: min-p, top-k, then top-p. [vocab] bool"""
    ref = (x / temperature)[None, :]
    if min_p:
        ref = MinPLogitsWarper(min_p)(None, ref)
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)
    return torch.isfinite(ref[0])
