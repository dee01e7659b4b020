"""Host-to-device copies that do not wait for the device."""

from __future__ import annotations

import numpy as np
import torch


def to_device(array: np.ndarray, device: torch.device, dtype: np.dtype | None = None) -> torch.Tensor:
    """A host array on the device (as dtype). On CUDA the copy goes through pinned memory and is queued behind the
    device's work instead of waiting for it: a copy from pageable memory would wait for the queue to drain, which
    would undo the overlap of async scheduling."""
    tensor = torch.from_numpy(np.ascontiguousarray(array if dtype is None else array.astype(dtype, copy=False)))
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a device tensor in pinned host memory, queued on the stream (valid once the stream gets there)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)
