"""LoRAConfig: how many adapters a step may hold (GPU slots), their largest rank, the host copies kept."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_RANK = 512


@dataclass
class LoRAConfig:
    max_loras: int = 1  # adapters in one step (their slots on the device)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept in host memory (LRU); None: max_loras
    lora_dtype: torch.dtype | None = None  # None: the model's dtype

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an integer >= 1")
        if self.max_lora_rank > MAX_RANK:
            raise ValueError(f"max_lora_rank={self.max_lora_rank}: allowed range [1, {MAX_RANK}]")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        value = self.max_cpu_loras
        if not isinstance(value, int) or isinstance(value, bool) or value < self.max_loras:
            raise ValueError(f"max_cpu_loras={value!r}: must be an integer >= max_loras={self.max_loras}")


def parse_lora_dtype(value: object, model_dtype: torch.dtype) -> torch.dtype:
    """lora_dtype as vLLM takes it: "auto" / None (the model's), a name or a torch dtype of a float type."""
    if value is None or value == "auto":
        return model_dtype
    names = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if isinstance(value, str) and value in names:
        return names[value]
    if isinstance(value, torch.dtype) and value in names.values():
        return value
    raise ValueError(f"lora_dtype={value!r}: must be one of auto, float32, float16, bfloat16")
