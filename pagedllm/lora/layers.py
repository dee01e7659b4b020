"""The layer seam: a LoRA-wrapped linear method adds each token's adapter term after the base method's output.

A layer's adapter slots: A [max_loras, num_slices * R, in] (the slices' A stacked along the rank) and
B [max_loras, out, R] (each output row's B row, the scaling folded in), R = max_lora_rank (smaller ranks are
zero-padded). A merged layer's slices are its projections (q, k, v of qkv_proj; gate, up of gate_up_proj).

With tensor parallelism the slots hold this rank's part, cut like the base layer's weight: a column-parallel layer's
B by its output rows (A whole), a row-parallel layer's A by its input features (B whole), so that the rank's partial
term joins the base output before the layer's all-reduce sums them."""

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
        shards = [layer.output_shard(s) for s in self.shard_ids]
        self.slices = [(start, rows) for start, rows, _ in shards]  # [(first output row on this rank, rows)]
        self.row_sources = [source for _, _, source in shards]  # first row of each slice in the whole projection
        self.full_rows = list(layer.output_sizes)  # each projection's rows over all ranks
        self.rank, self.input_size, self.full_input = rank, layer.input_size_per_partition, layer.input_size
        self.input_start = layer.tp_rank * self.input_size if self.input_size != self.full_input else 0
        num_slices = len(self.slices)
        self.a = torch.zeros(max_loras, num_slices * rank, self.input_size, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, layer.output_size_per_partition, rank, dtype=dtype, device=device)
        self.slice_starts = torch.tensor([s for s, _ in self.slices], dtype=torch.int64, device=device)
        self.slice_sizes = torch.tensor([n for _, n in self.slices], dtype=torch.int64, device=device)
        self.max_slice = max(n for _, n in self.slices)

    def rank_part(self, index: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This rank's part of projection `index`'s A [r, in] and B [out, r] (None: they do not fit the layer)."""
        if a.shape[1] != self.full_input or b.shape[0] != self.full_rows[index]:
            return None
        if self.input_size != self.full_input:
            a = a.narrow(1, self.input_start, self.input_size)
        return a, b.narrow(0, self.row_sources[index], self.slices[index][1])

    def set_slot(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Copies one adapter's (A [S*R, in], B [out, R]) into the slot; None zeroes it (adapter leaves layer out)."""
        if weights is None:
            self.a[slot].zero_()
            self.b[slot].zero_()
            return
        self.a[slot].copy_(weights[0], non_blocking=True)
        self.b[slot].copy_(weights[1], non_blocking=True)

    def add(self, x: torch.Tensor, out: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
        """out [num_tokens, out] += each adapter token's x @ A.T @ B.T (in place); returns out. No host sync and no
        branch on the data: the same launches run in a CUDA graph over a static mapping."""
        xs = x.reshape(-1, x.shape[-1]).to(self.a.dtype).contiguous()  # [num_tokens, in]
        y = out.view(-1, out.shape[-1])  # a view: the adds below must land in out
        m = mapping
        if use_triton(xs) and y.is_contiguous():
            from pagedllm.kernels.lora import lora_expand, lora_shrink

            t = lora_shrink(xs, self.a, m.sorted_tokens, m.blocks, m.num_blocks)
            lora_expand(t, self.b, y, m.sorted_tokens, m.blocks, m.num_blocks, self.slice_starts, self.slice_sizes,
                        self.max_slice)  # fmt: skip
        elif m.groups is None:  # a graph's mapping: every slot over every token, masked to its tokens
            for slot in range(self.a.shape[0]):
                keep = (m.token_slots == slot).unsqueeze(1).to(y.dtype)  # [num_tokens, 1]
                y += self._delta(xs, slot).to(y.dtype) * keep
        else:
            for slot, index in m.groups:
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


SIDE_MAX_TOKENS = 16  # steps of up to this many tokens compute the adapter terms on the side stream


class LoRALinearMethod(LinearMethodVariant):
    """The base method's output plus the adapter term of the step's adapter tokens (none: the base output).

    With a side stream (GPU) the adapter term is computed there into a zeroed buffer while the base GEMM runs on
    the current stream, which then waits for it and adds it: at small batches the term's kernels are bound by the
    latency of their dependent loads, not by bandwidth, and hide behind the GEMM's weight read. The fork and join
    are stream waits, which CUDA graphs capture. Larger steps keep one stream: their GEMMs fill the GPU, and the
    side stream's extra zeroing and add cost more than its overlap gives (H100, Llama-3.1-8B shapes: 8 adapters at
    256 rows, 0.815 -> 0.755 of the base model's tokens/s with the side stream at every size)."""

    def __init__(self, base: LinearMethod, side: torch.cuda.Stream | None = None) -> None:
        self.base, self.side = base, side

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        mapping = get_lora_mapping()
        if mapping is None:
            return self.base.apply(layer, x)
        if self.side is None or not x.is_cuda or x.shape[:-1].numel() > SIDE_MAX_TOKENS:
            return layer.lora.add(x, self.base.apply(layer, x), mapping)
        main = torch.cuda.current_stream(x.device)
        self.side.wait_stream(main)  # x is ready
        with torch.cuda.stream(self.side):
            delta = torch.zeros((*x.shape[:-1], layer.output_size_per_partition), dtype=x.dtype, device=x.device)
            layer.lora.add(x, delta, mapping)
        out = self.base.apply(layer, x)
        main.wait_stream(self.side)  # (the side stream's next work waits for this stream first: delta stays live)
        return out.add_(delta)
