"""LoRAMapping: which adapter slot each of a step's tokens uses, laid out for the grouped kernels and shared by every
layer. An eager step builds one to fit its tokens (`build_mapping`); CUDA graphs replay over `StaticLoRAMapping`'s
fixed-address buffers, refilled from the host before each replay."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.device import to_device

BLOCK_M = 16  # the grouped kernels' token block (kernels/lora.py)


@dataclass
class LoRAMapping:
    """sorted_tokens [>= num_lora_tokens]: the indices of the adapter tokens, grouped by slot;
    blocks [3, >= num_blocks]: per token block of one slot (at most BLOCK_M tokens) its first entry in sorted_tokens,
    its token count (0: an empty block, skipped) and its slot; num_blocks: the blocks the kernels' grids cover.
    token_slots [num_tokens]: each token's slot, -1 for the base model (the graphs' torch path reads it);
    groups: (slot, token indices or None for all tokens) per slot, for the eager torch path (None in graphs)."""

    sorted_tokens: torch.Tensor
    blocks: torch.Tensor
    num_blocks: int
    token_slots: torch.Tensor | None = None
    groups: list[tuple[int, torch.Tensor | None]] | None = None


def block_layout(token_slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sorted_tokens [num_lora_tokens], blocks [3, num_blocks], group slots [num_groups]) of token_slots
    [num_tokens] (-1: the base model). num_blocks <= cdiv(num_tokens, BLOCK_M) + num_groups - 1."""
    lora_tokens = np.flatnonzero(token_slots >= 0)
    slots = token_slots[lora_tokens]
    sorted_tokens = lora_tokens[np.argsort(slots, kind="stable")]
    group_slots, counts = np.unique(slots, return_counts=True)
    group_start = np.cumsum(counts) - counts  # [num_groups]
    per_group = -(-counts // BLOCK_M)  # token blocks of each group
    group = np.repeat(np.arange(len(counts)), per_group)  # [num_blocks] the group of each block
    index = np.arange(len(group)) - np.repeat(np.cumsum(per_group) - per_group, per_group)  # block's index in group
    first = group_start[group] + index * BLOCK_M
    blocks = np.stack([first, np.minimum(counts[group] - index * BLOCK_M, BLOCK_M), group_slots[group]])
    return sorted_tokens, blocks.astype(np.int64, copy=False), group_slots


def build_mapping(token_slots: np.ndarray, device: torch.device) -> LoRAMapping:
    """An eager step's mapping from token_slots [num_tokens] (at least one >= 0): one upload."""
    sorted_tokens, blocks, group_slots = block_layout(token_slots)
    n, nb = len(sorted_tokens), blocks.shape[1]
    # the table's width and offset padded to multiples of 16: every step launches the kernels with the same integer
    # and alignment specializations (Triton compiles another variant when a stride is 1 or not a multiple of 16)
    n_pad, nb_pad = -(-n // 16) * 16, -(-nb // 16) * 16
    table = np.zeros((3, nb_pad), dtype=np.int64)
    table[:, :nb] = blocks
    packed = to_device(np.concatenate([sorted_tokens, np.zeros(n_pad - n, dtype=np.int64), table.ravel()]), device)
    sorted_dev = packed[:n]
    if len(group_slots) == 1 and n == len(token_slots):  # one adapter for the whole batch: no gather
        groups = [(int(group_slots[0]), None)]
    else:
        bounds = np.searchsorted(token_slots[sorted_tokens], group_slots, side="right")
        starts = np.concatenate([[0], bounds[:-1]])
        groups = [(int(s), sorted_dev[a:b]) for s, a, b in zip(group_slots, starts.tolist(), bounds.tolist())]
    return LoRAMapping(sorted_dev, packed[n_pad:].view(3, nb_pad), nb, groups=groups)


class StaticLoRAMapping:
    """The graphs' mapping: fixed device buffers for up to max_tokens tokens and max_loras slots, and their pinned
    host staging. A graph of size bs covers cdiv(bs, BLOCK_M) + max_loras blocks (enough for any mix of slots);
    unused blocks have count 0. The caller orders the staging's reuse after the previous copy (load's comment)."""

    def __init__(self, max_tokens: int, max_loras: int, device: torch.device) -> None:
        self.max_tokens, self.max_loras = max_tokens, max_loras
        self.max_blocks = -(-max_tokens // BLOCK_M) + max_loras
        size = 2 * max_tokens + 3 * self.max_blocks  # token slots, sorted tokens, blocks
        self.host = torch.zeros(size, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.dev = torch.zeros(size, dtype=torch.int64, device=device)
        self.token_slots = self.dev[:max_tokens]  # [max_tokens]
        self.sorted_tokens = self.dev[max_tokens : 2 * max_tokens]  # [max_tokens]
        self.blocks = self.dev[2 * max_tokens :].view(3, self.max_blocks)  # [3, max_blocks]
        self.clear()

    def num_blocks(self, bs: int) -> int:
        return -(-bs // BLOCK_M) + self.max_loras

    def view(self, bs: int) -> LoRAMapping:
        """The mapping a graph of bs tokens is captured with (it reads the buffers at replay)."""
        return LoRAMapping(self.sorted_tokens, self.blocks, self.num_blocks(bs), token_slots=self.token_slots[:bs])

    def clear(self) -> None:
        """Every token on the base model (warm-ups, capture, profiling)."""
        self.load(None, 0)

    def load(self, token_slots: np.ndarray | None, n: int) -> None:
        """Stages token_slots [n] (None: all -1) and queues the copy to the device. The previous copy must have
        left the staging (the graph runner's copy event covers it: load runs between its wait and its record)."""
        h = self.host.numpy()
        m = self.max_tokens
        h[:m] = -1
        h[2 * m :] = 0
        if token_slots is not None and (token_slots >= 0).any():
            h[:n] = token_slots
            sorted_tokens, blocks, _ = block_layout(token_slots)
            h[m : m + len(sorted_tokens)] = sorted_tokens
            table = h[2 * m :].reshape(3, self.max_blocks)
            table[:, : blocks.shape[1]] = blocks
        self.dev.copy_(self.host, non_blocking=True)
