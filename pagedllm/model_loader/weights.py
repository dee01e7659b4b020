"""Checkpoint readers: each yields (hf_name, tensor) pairs."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch


def _checkpoint_files(model_dir: str, index_name: str, patterns: tuple[str, ...]) -> list[str]:
    """The shards named by the checkpoint's index file, else the files of the usual HF names.

    (Repos may ship other files beside the HF shards, such as consolidated.safetensors or training_args.bin.)"""
    index = os.path.join(model_dir, index_name)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, s) for s in shards]
    for pattern in patterns:
        files = sorted(glob.glob(os.path.join(model_dir, pattern)))
        if files:
            return files
    return []


def safetensors_files(model_dir: str) -> list[str]:
    return _checkpoint_files(model_dir, "model.safetensors.index.json", ("model*.safetensors", "*.safetensors"))


def pt_files(model_dir: str) -> list[str]:
    return _checkpoint_files(model_dir, "pytorch_model.bin.index.json", ("pytorch_model*.bin", "model*.pt"))


def safetensors_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:  # memory mapped
            for name in f.keys():
                yield name, f.get_tensor(name)


def pt_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    for path in pt_files(model_dir):
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        yield from state.items()


_FORMAT_FILES = {
    "safetensors": (safetensors_files, "*.safetensors"),
    "pt": (pt_files, "pytorch_model*.bin or model*.pt"),
}


def check_load_format(model_path: str, load_format: str) -> None:
    """A ValueError, before anything loads, when the model holds no weights of the asked format; it names the weight
    files that are there."""
    if load_format in ("auto", "dummy"):
        if load_format == "auto":
            detect_format(model_path)
        return
    is_gguf = model_path.endswith(".gguf")
    if load_format == "gguf" and is_gguf:
        return
    if load_format in _FORMAT_FILES and not is_gguf and _FORMAT_FILES[load_format][0](model_path):
        return
    wanted = ".gguf file" if load_format == "gguf" else _FORMAT_FILES[load_format][1]
    found = [os.path.basename(model_path)] if is_gguf else _weight_files(model_path)
    raise ValueError(
        f"load_format={load_format!r} but {model_path!r} has no weights of that format ({wanted}); weight files "
        f"found: {found}; use load_format='auto' to read them"
    )


def _weight_files(model_dir: str) -> list[str]:
    names = sorted(os.listdir(model_dir))
    return [n for n in names if n.endswith((".safetensors", ".bin", ".pt", ".pth", ".gguf"))]


def detect_format(model_path: str) -> str:
    if model_path.endswith(".gguf"):
        return "gguf"
    if safetensors_files(model_path):
        return "safetensors"
    if pt_files(model_path):
        return "pt"
    raise ValueError(f"no weights found in {model_path!r} (expected *.safetensors, *.bin or a .gguf file)")


def dummy_init(model: torch.nn.Module, seed: int) -> None:
    """Random weights of the right shapes (for benchmarks): small uniform values, norms around 1."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    gpu_gens: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if param.device.type == "cuda" and param.device not in gpu_gens:
            gpu_gens[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        fill = getattr(param, "dummy_fill", None)
        if fill is not None:  # a tensor with structure (a group index, a shape): its method fills it
            fill(param.data)
            continue
        if not param.dtype.is_floating_point:  # packed integer weights: random bits
            param.data.random_(generator=gpu_gens[param.device] if param.device.type == "cuda" else gen)
            continue
        if param.device.type == "cuda":  # drawn in place on the GPU: an 8B model in seconds, not minutes
            param.data.uniform_(-1e-2, 1e-2, generator=gpu_gens[param.device])
            if "norm" in name:
                param.data += 1.0
            continue
        values = torch.empty(param.shape, dtype=torch.float32).uniform_(-1e-2, 1e-2, generator=gen)
        if "norm" in name:
            values += 1.0
        param.data.copy_(values)
