"""LoRARequest: which adapter a request runs with (vLLM's class and field names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by a name, a positive integer id unique to its folder, and the folder (PEFT layout:
    adapter_config.json + adapter_model.safetensors or .bin). Requests with the same id share the adapter."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name={self.lora_name!r}: must be a non-empty string")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id={self.lora_int_id!r}: must be an integer >= 1")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path={self.lora_path!r}: must name the adapter's folder")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


def lora_list(lora_request: object, n: int) -> list:
    """A call's lora_request for its n prompts: None, one LoRARequest for all, or one (or None) per prompt."""
    if isinstance(lora_request, (list, tuple)):
        if len(lora_request) != n:
            raise ValueError(f"lora_request has {len(lora_request)} entries but there are {n} prompts")
        return list(lora_request)
    return [lora_request] * n
