"""4-bit grouped weights kept packed (GGUF Q4_0 / Q4_1), multiplied by the project's C kernel (cpu_quant.c) or,
without a C compiler, torch's int4 CPU kernel.

A Q4 group of 32 weights is w = (q - 8) * scale + zero with q in 0..15, which is the layout of
`torch.ops.aten._weight_int4pack_mm_for_cpu`. Small batches are bound by memory bandwidth, and the 4-bit kernels
read about a third of the bytes of bf16 weights; but they cost time per row, so past MAX_ROWS rows (measured
crossover about 24 for torch's kernel on an AVX512-BF16 CPU) the dense half-precision copy, kept beside it, is
faster."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedllm.kernels import cpu_quant

GROUP = 32
MAX_ROWS = 16  # batches of up to this many tokens use the int4 kernel


@dataclass
class PackedQ4:
    q: torch.Tensor  # [rows, cols] uint8 in 0..15
    scale: torch.Tensor  # [rows, cols / 32] float32
    zero: torch.Tensor  # [rows, cols / 32] float32

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> PackedQ4:
        return PackedQ4(fn(self.q), fn(self.scale), fn(self.zero))

    def narrow(self, dim: int, start: int, length: int) -> PackedQ4:
        """Rows (dim 0) or columns (dim 1, in whole groups) of the tensor, as torch.Tensor.narrow."""
        if dim == 0:
            return self.map_rows(lambda t: t.narrow(0, start, length))
        if start % GROUP or length % GROUP:
            raise ValueError(f"4-bit columns {start}+{length} must be whole groups of {GROUP}")
        groups = lambda t: t.narrow(1, start // GROUP, length // GROUP)  # noqa: E731
        return PackedQ4(self.q.narrow(1, start, length), groups(self.scale), groups(self.zero))

    def dequantize(self) -> torch.Tensor:  # [rows, cols] float32
        expand = lambda t: t.repeat_interleave(GROUP, dim=1)  # noqa: E731
        return (self.q.float() - 8) * expand(self.scale) + expand(self.zero)


def q4_kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


class Q4Accumulator:
    """Collects the 4-bit shards of one (possibly merged) linear weight while loading."""

    def __init__(self, rows: int, cols: int) -> None:
        self.q = torch.zeros(rows, cols, dtype=torch.uint8)  # [rows, cols]
        self.scale = torch.zeros(rows, cols // GROUP)  # [rows, groups]
        self.zero = torch.zeros(rows, cols // GROUP)
        self.packed_rows = torch.zeros(rows, dtype=torch.bool)

    def put(self, start: int, part: PackedQ4) -> None:
        n = part.q.shape[0]
        self.q[start : start + n] = part.q
        self.scale[start : start + n] = part.scale
        self.zero[start : start + n] = part.zero
        self.packed_rows[start : start + n] = True

    def finish(self, weight: torch.Tensor) -> cpu_quant.QuantWeight | tuple[torch.Tensor, torch.Tensor] | None:
        """Writes the 4-bit rows into the dense `weight`; when every row is 4-bit returns the C kernel's packing
        (a QuantWeight), else without the C kernels torch's int4 packing (packed weight, scales_and_zeros) where
        torch takes this shape; otherwise None."""
        rows = self.packed_rows.nonzero().squeeze(1)
        weight.data[rows] = PackedQ4(self.q[rows], self.scale[rows], self.zero[rows]).dequantize().to(weight.dtype)
        if not bool(self.packed_rows.all()):
            return None
        if weight.device.type == "cpu" and cpu_quant.available():
            return cpu_quant.pack_q4(self.q, self.scale, self.zero)
        try:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self.q.to(torch.int32), 1)
        except RuntimeError:
            return None
        sz = torch.stack([self.scale, self.zero], dim=-1).transpose(0, 1).contiguous()  # [groups, rows, 2]
        return packed, sz.to(weight.dtype)


def q4_matmul(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """x [..., cols] -> [..., rows] through the int4 kernel."""
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, x.shape[-1]), packed, GROUP, scales_and_zeros)
    return out.view(*x.shape[:-1], out.shape[-1])
