"""Reading a PEFT LoRA adapter folder: adapter_config.json and adapter_model.safetensors (or .bin, read with
weights_only=True). Each target module's A [r, in] and B [out, r] with its scaling (lora_alpha / r, or
lora_alpha / sqrt(r) with use_rslora; alpha_pattern / rank_pattern per module). What pagedllm cannot apply is refused
with a ValueError naming it: DoRA, LoRA biases, modules_to_save, added vocabulary, non-linear targets."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")


@dataclass
class PEFTAdapter:
    path: str
    config: dict
    modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]]  # module name -> (A [r, in], B [out, r], scaling)

    @property
    def rank(self) -> int:
        return max(a.shape[0] for a, _, _ in self.modules.values())


def read_adapter_config(path: str, max_rank: int) -> dict:
    """The folder's adapter_config.json, checked for what pagedllm applies (raises ValueError)."""
    if not os.path.isdir(path):
        raise ValueError(f"lora_path={path!r}: no such folder")
    file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(file):
        raise ValueError(f"lora_path={path!r}: no adapter_config.json in the folder (a PEFT adapter needs one)")
    with open(file, encoding="utf-8") as f:
        config = json.load(f)
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(f"lora_path={path!r}: peft_type={peft_type!r}; only LORA adapters are supported")
    for key, what in (("use_dora", "DoRA"), ("lora_bias", "LoRA biases")):
        if config.get(key):
            raise ValueError(f"lora_path={path!r}: {key}=true ({what}) is not supported")
    if config.get("modules_to_save"):
        raise ValueError(
            f"lora_path={path!r}: modules_to_save={config['modules_to_save']!r} is not supported (the adapter "
            "replaces whole modules of the base model)"
        )
    for name in ("new_embeddings.safetensors", "new_embeddings.bin"):
        if os.path.isfile(os.path.join(path, name)):
            raise ValueError(f"lora_path={path!r}: {name}: adapters that add vocabulary are not supported")
    ranks = [config.get("r", 8), *(config.get("rank_pattern") or {}).values()]
    rank = max(int(r) for r in ranks)
    if rank > max_rank:
        raise ValueError(f"lora_path={path!r}: rank r={rank} is above max_lora_rank={max_rank}; raise max_lora_rank")
    return config


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    file = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(file):
        from safetensors.torch import load_file

        return load_file(file)
    file = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(file):
        return torch.load(file, map_location="cpu", weights_only=True)
    raise ValueError(f"lora_path={path!r}: no adapter_model.safetensors or adapter_model.bin in the folder")


def _pattern_value(patterns: dict, module: str, default: float) -> float:
    """PEFT's per-module override: the first pattern key that ends the module's dotted name."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def load_peft_adapter(path: str, max_rank: int) -> PEFTAdapter:
    """Reads and checks the adapter folder; tensors stay on the CPU in float32."""
    config = read_adapter_config(path, max_rank)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in _read_tensors(path).items():
        name = key[len(PREFIX) :] if key.startswith(PREFIX) else key
        match = _KEY.match(name)
        if match is None:
            raise ValueError(f"lora_path={path!r}: tensor {key!r} is not a LoRA A/B weight (not supported)")
        pairs.setdefault(match["module"], {})[match["which"]] = tensor.float()
    if not pairs:
        raise ValueError(f"lora_path={path!r}: the adapter holds no LoRA weights")
    modules = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"lora_path={path!r}: module {module!r} has lora_{'A' if 'A' not in ab else 'B'} missing")
        a, b = ab["A"], ab["B"]
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank:
            raise ValueError(
                f"lora_path={path!r}: module {module!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                "are not [r, in] and [out, r]"
            )
        if rank > max_rank:
            raise ValueError(f"lora_path={path!r}: module {module!r} has rank {rank} > max_lora_rank={max_rank}")
        alpha = _pattern_value(config.get("alpha_pattern"), module, config.get("lora_alpha", 8))
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        modules[module] = (a, b, float(scaling))
    return PEFTAdapter(path, config, modules)
