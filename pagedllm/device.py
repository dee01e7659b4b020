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


def pinned_copies(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """pinned_copy of each device tensor; contiguous tensors over one storage (as the sampling kernel's tokens and
    logprobs) in one copy of the span they cover."""
    ptr = tensors[0].untyped_storage().data_ptr()
    if any(t.untyped_storage().data_ptr() != ptr or not t.is_contiguous() for t in tensors):
        return [pinned_copy(t) for t in tensors]
    spans = [(t.storage_offset() * t.element_size(), t.numel() * t.element_size()) for t in tensors]  # bytes
    lo, hi = min(s for s, _ in spans), max(s + n for s, n in spans)
    span = torch.empty(0, dtype=torch.uint8, device=tensors[0].device)
    host = pinned_copy(span.set_(tensors[0].untyped_storage(), lo, (hi - lo,)))
    return [host[s - lo : s - lo + n].view(t.dtype).view(t.shape) for t, (s, n) in zip(tensors, spans)]


class Staging:
    """Host-to-device copies of int32 words through pinned buffers kept from copy to copy (a ring of them), for
    uploads made step after step: no pinned allocation per copy, one copy launched. A buffer is written again only
    once its last copy has left it (an event), and its device buffer only once the work queued before that copy has
    read it (the copy is queued behind it on the stream). Off CUDA the words are simply copied."""

    def __init__(self, device: torch.device, slots: int = 2) -> None:
        self.device = device
        self.slots: list[list] = [[None, None, None] for _ in range(slots)]  # [pinned host, device, event] each
        self.next = 0

    def upload(self, words: np.ndarray) -> torch.Tensor:
        """words [n] int32 on the device (valid until this slot is used again: `slots` uploads later)."""
        if self.device.type != "cuda":
            return torch.from_numpy(words.copy()).to(self.device)
        slot = self.slots[self.next]
        self.next = (self.next + 1) % len(self.slots)
        host, dev, copied = slot
        n = len(words)
        if host is None or len(host) < n:
            size = max(n, 1024) * 2
            host = slot[0] = torch.empty(size, dtype=torch.int32, pin_memory=True)
            dev = slot[1] = torch.empty(size, dtype=torch.int32, device=self.device)
        elif copied is not None:
            copied.synchronize()  # the last copy from this host buffer is done
        host.numpy()[:n] = words
        out = dev[:n]
        out.copy_(host[:n], non_blocking=True)
        slot[2] = torch.cuda.Event()
        slot[2].record()
        return out
