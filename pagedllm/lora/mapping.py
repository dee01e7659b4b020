"""LoRAMapping: one step's tokens grouped by adapter slot, built once on the host and shared by every layer."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.device import to_device

BLOCK_M = 16  # the grouped kernels' token block (kernels/lora.py)


class LoRAMapping:
    """token_slots [num_tokens]: each token's adapter slot, -1 for the base model (at least one is >= 0).

    sorted_tokens [num_lora_tokens]: the indices of the adapter tokens, grouped by slot (ascending);
    starts [num_groups + 1]: each group's first entry; slots [num_groups]: its slot; num_m: token blocks of the
    largest group; groups: (slot, token indices or None for all tokens) per group, for the torch path."""

    def __init__(self, token_slots: np.ndarray, device: torch.device) -> None:
        lora_tokens = np.flatnonzero(token_slots >= 0)
        slots = token_slots[lora_tokens]
        order = np.argsort(slots, kind="stable")
        group_slots, counts = np.unique(slots, return_counts=True)
        starts = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=starts[1:])
        packed = self._to_device(np.concatenate([lora_tokens[order], starts, group_slots]), device)
        n, g = len(lora_tokens), len(counts)
        self.sorted_tokens = packed[:n]  # [num_lora_tokens]
        self.starts = packed[n : n + g + 1]  # [num_groups + 1]
        self.slots = packed[n + g + 1 :]  # [num_groups]
        self.num_m = int(-(-counts.max() // BLOCK_M))
        if g == 1 and n == len(token_slots):  # one adapter for the whole batch: no gather
            self.groups = [(int(group_slots[0]), None)]
        else:
            self.groups = [(int(s), self.sorted_tokens[starts[i] : starts[i + 1]]) for i, s in enumerate(group_slots)]

    @staticmethod
    def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
        return to_device(np.ascontiguousarray(array, dtype=np.int64), device)
