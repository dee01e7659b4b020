"""Checkpoint readers: each yields (hf_name, tensor) pairs."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator

import torch


def safetensors_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:  # memory mapped
            for name in f.keys():
                yield name, f.get_tensor(name)


def pt_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    for path in sorted(glob.glob(os.path.join(model_dir, "*.bin")) + glob.glob(os.path.join(model_dir, "*.pt"))):
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        yield from state.items()


def detect_format(model_path: str) -> str:
    if model_path.endswith(".gguf"):
        return "gguf"
    if glob.glob(os.path.join(model_path, "*.safetensors")):
        return "safetensors"
    if glob.glob(os.path.join(model_path, "*.bin")) or glob.glob(os.path.join(model_path, "*.pt")):
        return "pt"
    raise ValueError(f"no weights found in {model_path!r} (expected *.safetensors, *.bin or a .gguf file)")


def dummy_init(model: torch.nn.Module, seed: int) -> None:
    """Random weights of the right shapes (for benchmarks): small uniform values, norms around 1."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in model.named_parameters():
        values = torch.empty(param.shape, dtype=torch.float32).uniform_(-1e-2, 1e-2, generator=gen)
        if "norm" in name:
            values += 1.0
        param.data.copy_(values)
