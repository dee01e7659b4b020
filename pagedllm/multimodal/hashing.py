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


def apply_uuids(features: list, mm_data: Any, uuids: Any, where: str) -> None:
    """multi_modal_uuids (vLLM's): the user's stable id of each item replaces its content hash as the key of the
    encoder cache and of the prefix-cache blocks it fills; None keeps the content hash. {modality: id or [ids]},
    one id per item of every modality in multi_modal_data. Items must still be sent (no media skipped by id)."""
    if uuids is None:
        return
    where = f"{where}.multi_modal_uuids"
    given = {m: v for m, v in mm_data.items() if v is not None} if isinstance(mm_data, dict) else {}
    if not isinstance(uuids, dict) or set(uuids) != set(given):
        raise ValueError(f"{where} must be a dict with the modalities of multi_modal_data {sorted(given)}")
    for modality, ids in uuids.items():
        items = [f for f in features if f.modality == modality]  # in prompt order: the order of the items
        ids = list(ids) if isinstance(ids, (list, tuple)) else [ids]
        if len(ids) != len(items) or not all(i is None or (isinstance(i, str) and i) for i in ids):
            raise ValueError(
                f"{where}[{modality!r}]: {len(ids)} ids for {len(items)} items; give one non-empty str (or None: "
                "the content hash) per item"
            )
        for feature, uuid in zip(items, ids):
            if uuid is not None:
                feature.identifier = hashlib.sha256(f"uuid:{modality}:{uuid}".encode()).hexdigest()
