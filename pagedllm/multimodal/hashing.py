"""Content hashes of multimodal items: the encoder cache key and the prefix-cache key of the blocks an item fills.
Equal pixels and equal processor options give equal hashes, whatever object carried them."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import torch


def hash_item(modality: str, item: Any, processor_kwargs: dict) -> str:
    h = hashlib.sha256(modality.encode())
    h.update(json.dumps(processor_kwargs, sort_keys=True, default=repr).encode())
    if isinstance(item, dict):  # Qwen2-VL's precomputed embeddings with their grid
        for key in sorted(item):
            h.update(f"{key}:{hash_item(modality, item[key], {})}".encode())
        return h.hexdigest()
    if isinstance(item, torch.Tensor):  # precomputed embeddings
        item = item.detach().cpu().contiguous()
        h.update(f"tensor{item.dtype}{tuple(item.shape)}".encode())
        h.update(item.view(torch.uint8).numpy().tobytes())
    elif isinstance(item, np.ndarray):
        h.update(f"ndarray{item.dtype}{item.shape}".encode())
        h.update(np.ascontiguousarray(item).tobytes())
    else:  # a PIL image
        h.update(f"{item.mode}{item.size}".encode())
        h.update(item.tobytes())
    return h.hexdigest()
