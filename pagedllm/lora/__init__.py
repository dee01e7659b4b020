"""Multi-LoRA: PEFT adapters served from one base model, many in one batch (see request.py, manager.py)."""

from pagedllm.lora.config import LoRAConfig
from pagedllm.lora.request import LoRARequest

__all__ = ["LoRAConfig", "LoRARequest"]
