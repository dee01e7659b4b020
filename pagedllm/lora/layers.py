"""The layer seam: a LoRA-wrapped linear method adds each token's adapter term after the base method's output.

A layer's adapter slots: A [max_loras, num_slices * R, in] (the slices' A stacked along the rank) and
B [max_loras, out, R] (each output row's B row, the scaling folded in), R = max_lora_rank (smaller ranks are
zero-padded). A merged layer's slices are its projections (q, k, v of qkv_proj; gate, up of gate_up_proj)."""

from __future__ import annotations

import torch

from pagedllm.forward_context import get_lora_mapping
from pagedllm.kernels import use_triton
from pagedllm.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear
from pagedllm.layers.quantization.base import LinearMethod, LinearMethodVariant
from pagedllm.lora.mapping import LoRAMapping


def slice_ids(layer: LinearBase) -> list[object]:
    """The shard ids of the layer's projections, in output order (None: one projection)."""
    if isinstance(layer, QKVParallelLinear):
        return ["q", "k", "v"]
    if isinstance(layer, MergedColumnParallelLinear):
        return list(range(len(layer.output_sizes)))
    return [None]


class LoRALayerWeights:
    """A linear layer's adapter slots on the device."""

    def __init__(self, layer: LinearBase, max_loras: int, rank: int, dtype: torch.dtype, device) -> None:
        self.shard_ids = slice_ids(layer)
        self.slices = [layer.output_shard(s)[:2] for s in self.shard_ids]  # [(first output row, rows)]
        self.rank, self.input_size = rank, layer.input_size_per_partition
        num_slices = len(self.slices)
        self.a = torch.zeros(max_loras, num_slices * rank, self.input_size, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, layer.output_size_per_partition, rank, dtype=dtype, device=device)
        self.slice_starts = torch.tensor([s for s, _ in self.slices], dtype=torch.int64, device=device)
        self.slice_sizes = torch.tensor([n for _, n in self.slices], dtype=torch.int64, device=device)
        self.max_slice = max(n for _, n in self.slices)

    def set_slot(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Copies one adapter's (A [S*R, in], B [out, R]) into the slot; None zeroes it (adapter leaves layer out)."""
        if weights is None:
            self.a[slot].zero_()
            self.b[slot].zero_()
            return
        self.a[slot].copy_(weights[0], non_blocking=True)
        self.b[slot].copy_(weights[1], non_blocking=True)

    def add(self, x: torch.Tensor, out: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
        """out [num_tokens, out] += each adapter token's x @ A.T @ B.T (in place); returns out."""
        xs = x.reshape(-1, x.shape[-1]).to(self.a.dtype).contiguous()  # [num_tokens, in]
        y = out.view(-1, out.shape[-1])  # a view: the adds below must land in out
        if use_triton(xs) and y.is_contiguous():
            from pagedllm.kernels.lora import lora_expand, lora_shrink

            t = lora_shrink(xs, self.a, mapping.sorted_tokens, mapping.starts, mapping.slots, mapping.num_m)
            lora_expand(t, self.b, y, mapping.sorted_tokens, mapping.starts, mapping.slots, mapping.num_m,
                        self.slice_starts, self.slice_sizes, self.max_slice)  # fmt: skip
            return out
        for slot, index in mapping.groups:
            rows = xs if index is None else xs.index_select(0, index)
            delta = self._delta(rows, slot).to(y.dtype)  # [rows, out]
            if index is None:
                y += delta
            else:
                y.index_add_(0, index, delta)
        return out

    def _delta(self, rows: torch.Tensor, slot: int) -> torch.Tensor:
        t = rows @ self.a[slot].T  # [rows, S * R]
        b, r = self.b[slot], self.rank
        if len(self.slices) == 1:
            return t @ b.T
        parts = [t[:, i * r : (i + 1) * r] @ b[start : start + n].T for i, (start, n) in enumerate(self.slices)]
        return torch.cat(parts, dim=1)


class LoRALinearMethod(LinearMethodVariant):
    """The base method's output plus the adapter term of the step's adapter tokens (none: the base output)."""

    def __init__(self, base: LinearMethod) -> None:
        self.base = base

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        out = self.base.apply(layer, x)
        mapping = get_lora_mapping()
        return out if mapping is None else layer.lora.add(x, out, mapping)
