"""Triton kernels for the GPU path: paged attention (unified varlen prefill + decode, split-K), the KV-cache write,
the small fused ops (RMSNorm, residual-add + RMSNorm, SiLU-and-mul, rotary), and the sampler's (sampling,
penalties, logprobs).

Importing this package never imports triton; the kernel modules do, and only the CUDA path imports them."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(x: torch.Tensor) -> bool:
    """Whether the fused Triton op runs for `x`: on CUDA tensors when triton is installed (CPU keeps torch)."""
    return x.is_cuda and triton_available()


def interpreting() -> bool:
    """Whether Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1): no inline PTX, no PDL."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _pdl_device(index: int) -> bool:
    """Whether kernels on CUDA device `index` take part: compute capability 9.0 or later, compiled (not under
    Triton's interpreter) by a Triton with the grid-dependency instructions (3.4 and later)."""
    import triton.language as tl

    cuda = getattr(getattr(tl, "extra", None), "cuda", None)
    if interpreting() or not hasattr(cuda, "gdc_wait"):
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl(x: torch.Tensor) -> dict:
    """The launch arguments of a kernel taking part in programmatic dependent launch (Hopper and later): launched
    with launch_pdl, such a kernel's programs may start while the kernel before it on the stream finishes, so its
    launch overlaps that kernel's tail. USE_PDL makes the kernel wait (gdc_wait) before it touches any memory, which
    makes everything the kernels before it wrote visible and keeps it from writing what they still read, then let
    the next kernel launch (gdc_launch_dependents). Off elsewhere (see _pdl_device)."""
    on = x.is_cuda and _pdl_device(x.device.index if x.device.index is not None else torch.cuda.current_device())
    return {"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False}


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, -1) of [rows, vocab]: the sliced Triton kernel on CUDA (kernels/argmax.py), torch's
    argmax elsewhere."""
    if not use_triton(logits):
        return logits.argmax(dim=-1)
    from pagedllm.kernels.argmax import argmax_rows

    return argmax_rows(logits)


class SplitCounters:
    """Zeroed int32 arrival counters for kernels whose last program per output block sums the split-K partials (each
    launch leaves them zeroed, so launches on one device must not overlap: one stream), kept per device. Buffers
    outgrown are kept alive: CUDA graphs captured with them still use them."""

    def __init__(self) -> None:
        self.buffers: dict[torch.device, torch.Tensor] = {}
        self.outgrown: list[torch.Tensor] = []

    def take(self, device: torch.device, n: int) -> torch.Tensor | None:
        """At least n counters; None while a CUDA graph is being captured and the buffer would have to grow (the
        caller then sums in a kernel of its own)."""
        buf = self.buffers.get(device)
        if buf is None or buf.numel() < n:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None
            if buf is not None:
                self.outgrown.append(buf)
            buf = self.buffers[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        return buf
