"""Attention backends: `torch_backend` (the reference, runs anywhere) and `triton_backend` (Triton kernels, CUDA).

A backend is a module: allocate_kv_cache, build_metadata, forward, and SUPPORTS_CUDA_GRAPHS (whether a decode
step's forward can be captured in a CUDA graph; such a backend also has static_decode_metadata, choose_num_splits
and num_sms for the graphs' metadata)."""

from __future__ import annotations

from types import ModuleType

import torch

from pagedllm.kernels import triton_available


def get_backend(name: str, device: torch.device) -> ModuleType:
    """The backend module for `attention_backend` (auto | torch | triton): auto picks triton on CUDA when triton is
    installed, else torch."""
    if name == "auto":
        name = "triton" if device.type == "cuda" and triton_available() else "torch"
    if name == "triton":
        if device.type != "cuda":
            raise ValueError(f"attention_backend='triton' runs on CUDA devices only, not device={str(device)!r}")
        from pagedllm.attention import triton_backend

        return triton_backend
    if name != "torch":
        raise ValueError(f"attention_backend={name!r} must be one of auto, torch, triton")
    from pagedllm.attention import torch_backend

    return torch_backend
