"""LoRAManager: the adapters known to the runner, an LRU of their host copies (max_cpu_loras) and the device slots
(max_loras) that a step's adapters are loaded into."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

import numpy as np
import torch
from torch import nn

from pagedllm.lora.config import LoRAConfig
from pagedllm.lora.mapping import LoRAMapping, build_mapping
from pagedllm.lora.model import LoRAModel, SlotWeights
from pagedllm.lora.peft_adapter import load_peft_adapter
from pagedllm.lora.request import LoRARequest


def make_lora_manager(config, model: nn.Module, device: torch.device, context=None) -> LoRAManager | None:
    """The runner's LoRAManager for an EngineConfig (None: LoRA is off); context: the BuildContext the model was
    built with (with pipeline stages, adapters are checked against every stage's layers: a meta-device copy)."""
    if config.lora is None:
        return None
    whole = None
    if context is not None and context.pp_size > 1:
        from pagedllm.model_loader.loader import build_model

        whole = build_model(config.model, torch.device("meta"), replace(context, pp_rank=0, pp_size=1))
    return LoRAManager(model, config.lora, config.lora.lora_dtype or config.model.dtype, device, whole)


class LoRAManager:
    def __init__(
        self, model: nn.Module, config: LoRAConfig, dtype: torch.dtype, device: torch.device, whole=None
    ) -> None:
        self.config, self.device = config, device
        self.lora_model = LoRAModel(model, config.max_loras, config.max_lora_rank, dtype, device, whole)
        self.requests: dict[int, LoRARequest] = {}  # lora_int_id -> its request (the adapter's folder)
        self.host: OrderedDict[int, SlotWeights] = OrderedDict()  # host copies, least recently used first
        self.slot_ids: list[int | None] = [None] * config.max_loras  # slot -> the adapter id it holds
        self.slot_use: OrderedDict[int, None] = OrderedDict()  # slots by last use, least recent first

    def add(self, request: LoRARequest) -> bool:
        """Reads and checks the adapter (raises ValueError) and keeps its host copy; False if it was known."""
        if not isinstance(request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        known = self.requests.get(request.lora_int_id)
        if known is not None:
            if known.lora_path != request.lora_path:
                raise ValueError(
                    f"lora_int_id={request.lora_int_id} is already used by adapter {known.lora_name!r} at "
                    f"{known.lora_path!r}, not {request.lora_path!r}: give each adapter folder its own id"
                )
            return False
        self._host_copy(request)
        self.requests[request.lora_int_id] = request
        return True

    def remove(self, lora_id: int) -> bool:
        """Drops the adapter's host copy (its folder stays known: requests in flight read it again if they need
        it); the engine refuses new requests for it."""
        self.host.pop(lora_id, None)
        return lora_id in self.requests

    def list_loras(self) -> list[int]:
        return list(self.requests)

    def _host_copy(self, request: LoRARequest) -> SlotWeights:
        weights = self.host.get(request.lora_int_id)
        if weights is not None:
            self.host.move_to_end(request.lora_int_id)
            return weights
        adapter = load_peft_adapter(request.lora_path, self.config.max_lora_rank)
        weights = self.lora_model.slot_weights(adapter, pin=self.device.type == "cuda")
        self.host[request.lora_int_id] = weights
        while len(self.host) > self.config.max_cpu_loras:
            self.host.popitem(last=False)
        return weights

    def slots_for(self, lora_ids: list[int]) -> dict[int, int]:
        """A device slot for each of the step's adapters (at most max_loras: the scheduler's rule), loading those
        not in one into free or least recently used slots."""
        if len(lora_ids) > len(self.slot_ids):
            raise RuntimeError(f"{len(lora_ids)} adapters in one step; max_loras={len(self.slot_ids)}")
        held = {lora_id: slot for slot, lora_id in enumerate(self.slot_ids) if lora_id is not None}
        wanted = set(lora_ids)
        for lora_id in lora_ids:
            if lora_id not in held:
                slot = self._free_slot(wanted)
                self.lora_model.load_slot(slot, self._host_copy(self.requests[lora_id]))
                self.slot_ids[slot], held[lora_id] = lora_id, slot
            self.slot_use.pop(held[lora_id], None)
            self.slot_use[held[lora_id]] = None
        return {lora_id: held[lora_id] for lora_id in lora_ids}

    def _free_slot(self, wanted: set[int]) -> int:
        for slot, lora_id in enumerate(self.slot_ids):
            if lora_id is None:
                return slot
        for slot in self.slot_use:  # least recently used first, never one this step needs
            if self.slot_ids[slot] not in wanted:
                return slot
        raise RuntimeError("no free LoRA slot")

    def token_slots(self, token_lora_ids: np.ndarray) -> np.ndarray | None:
        """Each token's device slot [num_tokens] from its adapter id (0: the base model, slot -1), loading the step's
        adapters into slots; None when no token uses one."""
        ids = np.unique(token_lora_ids)
        ids = ids[ids > 0]
        if not len(ids):
            return None
        slots = self.slots_for(ids.tolist())
        table = np.full(int(ids.max()) + 1, -1, dtype=np.int64)
        table[ids] = [slots[i] for i in ids.tolist()]
        return table[token_lora_ids]

    def mapping(self, token_lora_ids: np.ndarray) -> LoRAMapping | None:
        """An eager step's mapping (None when no token uses an adapter)."""
        token_slots = self.token_slots(token_lora_ids)
        return None if token_slots is None else build_mapping(token_slots, self.device)
