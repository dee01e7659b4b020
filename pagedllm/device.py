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


class HostCopies:
    """Copies of device tensors into pinned host memory kept from step to step, read on the host as numpy arrays: a
    pinned allocation, and a torch view per tensor, cost host time every step. Views of one device buffer (as the
    sampling kernel's tokens and logprobs) travel in one copy of that buffer. A copy lends its pinned buffer until
    give_back (once the host has read it); the buffer is then written by later copies."""

    def __init__(self) -> None:
        self.free: list[_Pinned] = []
        self.spans: dict[tuple[int, int, int], torch.Tensor] = {}  # (storage, first byte, end) -> its bytes

    def copy(self, *tensors: torch.Tensor) -> tuple[list[np.ndarray], _Pinned | None]:
        """numpy arrays of the tensors' values on the host (valid once the stream has run the copies, until the
        buffer is given back), and the lent buffer (None off CUDA: the arrays are the tensors themselves)."""
        if not tensors[0].is_cuda:
            return [t.numpy() for t in tensors], None
        ptr = tensors[0].untyped_storage().data_ptr()
        if all(t.untyped_storage().data_ptr() == ptr and t.is_contiguous() for t in tensors):  # one copy
            at = [t.storage_offset() * t.element_size() for t in tensors]  # bytes into the storage
            lo, hi = min(at), max(a + _nbytes(t) for a, t in zip(at, tensors))
            sources, starts, size = [self._span(tensors[0], lo, hi)], [0], hi - lo
            at = [a - lo for a in at]
        else:  # a copy each, 16-byte aligned parts of one pinned buffer
            ends = np.cumsum([-(-_nbytes(t) // 16) * 16 for t in tensors]).tolist()
            sources, starts, size = tensors, [0] + ends[:-1], ends[-1]
            at = starts
        pinned = self._take(size)
        for source, start in zip(sources, starts):
            pinned.typed(start, source).copy_(source, non_blocking=True)
        arrays = [
            pinned.array[a : a + _nbytes(t)].view(_NUMPY[t.dtype]).reshape(t.shape) for a, t in zip(at, tensors)
        ]  # fmt: skip
        return arrays, pinned

    def _span(self, tensor: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Bytes lo to hi of the tensor's storage, as a uint8 tensor (kept: a buffer used step after step gets the
        same one; it keeps its storage, so no other storage takes that address meanwhile)."""
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), lo, hi)
        span = self.spans.get(key)
        if span is None:
            if len(self.spans) >= 8:
                self.spans.clear()
            span = self.spans[key] = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(
                storage, lo, (hi - lo,)
            )
        return span

    def give_back(self, pinned: _Pinned | None) -> None:
        if pinned is not None:
            self.free.append(pinned)

    def _take(self, nbytes: int) -> _Pinned:
        for i, pinned in enumerate(self.free):
            if len(pinned.array) >= nbytes:
                return self.free.pop(i)
        return _Pinned(max(nbytes, 4096))


class _Pinned:
    """A pinned host buffer, with its numpy view and its typed torch views (made once each)."""

    def __init__(self, nbytes: int) -> None:
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.array = self.tensor.numpy()
        self.views: dict[tuple, torch.Tensor] = {}

    def typed(self, start: int, like: torch.Tensor) -> torch.Tensor:
        """The buffer from byte start on as a tensor of like's shape and dtype."""
        key = (start, like.dtype, like.shape)
        view = self.views.get(key)
        if view is None:
            if len(self.views) >= 64:  # batches of many sizes: keep the latest
                self.views.clear()
            n = like.numel() * like.element_size()
            view = self.views[key] = self.tensor[start : start + n].view(like.dtype).view(like.shape)
        return view


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


_NUMPY = {  # the dtypes numpy has, as numpy's
    t: torch.empty(0, dtype=t).numpy().dtype
    for t in (
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.float64,
        torch.float32,
        torch.float16,
    )
}


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
