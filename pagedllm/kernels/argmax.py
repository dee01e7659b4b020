"""Each row's argmax of a [rows, vocab] float tensor on the GPU, as torch.argmax(x, -1) gives it (the first largest
token), in two launches: programs over TILE-token slices of every row keep their slice's largest value and its first
token, then one program per row takes the first slice holding the row's largest. torch's argmax reduces a row in
one program and takes ~35 us for one row of 128k bfloat16 logits on an H100; the slices spread it over the GPU.

NaN counts as the largest value (as in torch); a row holding both +inf and NaN gives the first of either."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.launch import Launch

TILE = 4096  # tokens per slice program (128k logits: 32 slices a row)


@triton.jit
def slice_max_kernel(x_ptr, val_ptr, idx_ptr, vocab, stride_x, num_slices, TILE: tl.constexpr):
    """Program p: row p // num_slices, slice p % num_slices -> its largest value (NaN as +inf) and first token."""
    pid = tl.program_id(0)
    row, s = pid // num_slices, pid % num_slices
    offs = s * TILE + tl.arange(0, TILE)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
    x = tl.where(x == x, x, float("inf"))
    best = tl.max(x, axis=0)
    first = tl.min(tl.where(x == best, offs, 2147483647), axis=0)
    tl.store(val_ptr + pid, best)
    tl.store(idx_ptr + pid, first)


@triton.jit
def row_argmax_kernel(val_ptr, idx_ptr, out_ptr, num_slices, SLICES: tl.constexpr):
    """Program r: the first token of the first of row r's slices holding its largest value."""
    row = tl.program_id(0)
    offs = tl.arange(0, SLICES)
    mask = offs < num_slices
    val = tl.load(val_ptr + row * num_slices + offs, mask=mask, other=float("-inf"))
    idx = tl.load(idx_ptr + row * num_slices + offs, mask=mask, other=2147483647)
    best = tl.max(val, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(val == best, idx, 2147483647), axis=0).to(tl.int64))


_slice_max, _row_argmax = Launch(slice_max_kernel), Launch(row_argmax_kernel)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of x [rows, vocab] (float, last dim contiguous) on the GPU -> [rows] int64."""
    rows, vocab = x.shape
    if rows == 0 or x.stride(-1) != 1:
        return x.argmax(dim=-1)
    num_slices = triton.cdiv(vocab, TILE)
    n = rows * num_slices
    val = torch.empty(n, dtype=torch.float32, device=x.device)
    idx = torch.empty(n, dtype=torch.int32, device=x.device)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    _slice_max(n, x, val, idx, vocab, x.stride(0), num_slices, TILE=TILE, num_warps=8)
    slices = max(16, triton.next_power_of_2(num_slices))
    _row_argmax(rows, val, idx, out, num_slices, SLICES=slices, num_warps=1)
    return out
