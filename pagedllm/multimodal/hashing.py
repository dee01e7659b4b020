"""Content hashes of multimodal items: the encoder cache key and the prefix-cache key of the blocks an item fills.
Equal pixels and equal processor options give equal hashes, whatever object carried them."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np


def hash_item(modality: str, item: Any, processor_kwargs: dict) -> str:
    h = hashlib.sha256(modality.encode())
    h.update(json.dumps(processor_kwargs, sort_keys=True, default=repr).encode())
    if isinstance(item, np.ndarray):
        h.update(f"ndarray{item.dtype}{item.shape}".encode())
        h.update(np.ascontiguousarray(item).tobytes())
    else:  # a PIL image
        h.update(f"{item.mode}{item.size}".encode())
        h.update(item.tobytes())
    return h.hexdigest()
