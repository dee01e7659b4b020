"""Grouped LoRA kernels (punica's SGMV layout): the step's tokens that use an adapter are sorted by its slot, and
each program multiplies a block of one adapter's tokens by that adapter's weights.

shrink: t[tok, :] = x[tok, :] @ A[slot].T             A [max_loras, num_slices * rank, in]   t float32
expand: y[tok, slice s] += t[tok, s-th rank block] @ B[slot, slice s rows].T   B [max_loras, out, rank]

Base-model tokens (slot -1) are in no group and are left alone. The grids are one-dimensional (flattened) so that
the launches go through `Launch`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.launch import Launch


@triton.jit
def lora_shrink_kernel(
    x_ptr,  # [num_tokens, K]
    a_ptr,  # [max_loras, N, K]
    t_ptr,  # [num_tokens, N] float32
    sorted_ptr,  # [num_lora_tokens] token indices grouped by adapter
    start_ptr,  # [num_groups + 1] each group's first entry in sorted
    slot_ptr,  # [num_groups] each group's slot
    K,
    N,
    stride_xm,
    stride_al,
    stride_an,
    stride_tm,
    NUM_M,  # token blocks per group (enough for the largest group)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    group = pid // (NUM_M * num_n)
    pid_m = (pid // num_n) % NUM_M
    pid_n = pid % num_n
    start = tl.load(start_ptr + group)
    count = tl.load(start_ptr + group + 1) - start
    if pid_m * BLOCK_M >= count:
        return
    slot = tl.load(slot_ptr + group).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
    tok = tl.load(sorted_ptr + start + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < K
        xs = tl.load(x_ptr + tok[:, None] * stride_xm + kk[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(
            a_ptr + slot * stride_al + offs_n[None, :] * stride_an + kk[:, None],
            mask=mask_k[:, None] & mask_n[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(xs, w)
    tl.store(t_ptr + tok[:, None] * stride_tm + offs_n[None, :], acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def lora_expand_kernel(
    t_ptr,  # [num_tokens, num_slices * R] float32
    b_ptr,  # [max_loras, out, R]
    y_ptr,  # [num_tokens, out]
    sorted_ptr,
    start_ptr,
    slot_ptr,
    slice_start_ptr,  # [num_slices] first output row of each slice
    slice_size_ptr,  # [num_slices]
    R,
    stride_tm,
    stride_bl,
    stride_bn,
    stride_ym,
    NUM_M,
    NUM_N: tl.constexpr,  # column blocks per slice (enough for the largest slice)
    NUM_SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_n = pid % NUM_N
    s = (pid // NUM_N) % NUM_SLICES
    pid_m = (pid // (NUM_N * NUM_SLICES)) % NUM_M
    group = pid // (NUM_N * NUM_SLICES * NUM_M)
    start = tl.load(start_ptr + group)
    count = tl.load(start_ptr + group + 1) - start
    n_start = tl.load(slice_start_ptr + s)
    n_size = tl.load(slice_size_ptr + s)
    if pid_m * BLOCK_M >= count or pid_n * BLOCK_N >= n_size:
        return
    slot = tl.load(slot_ptr + group).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
    tok = tl.load(sorted_ptr + start + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n_size
    cols = n_start + offs_n
    ts = tl.load(t_ptr + tok[:, None] * stride_tm + s * R + offs_r[None, :], mask=mask_m[:, None] & mask_r[None, :])
    w = tl.load(
        b_ptr + slot * stride_bl + cols[None, :] * stride_bn + offs_r[:, None],
        mask=mask_r[:, None] & mask_n[None, :],
        other=0.0,
    )  # [BLOCK_R, BLOCK_N]
    acc = tl.dot(ts.to(w.dtype), w)
    y_ptrs = y_ptr + tok[:, None] * stride_ym + cols[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


_shrink, _expand = Launch(lora_shrink_kernel), Launch(lora_expand_kernel)
BLOCK_M = 16  # tl.dot's smallest tile: decode groups are often a few tokens


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


def lora_shrink(
    x: torch.Tensor, a: torch.Tensor, sorted_tokens: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor, num_m: int
) -> torch.Tensor:
    """x [num_tokens, in] (a's dtype), a [max_loras, N, in] -> t [num_tokens, N] float32 (rows of base tokens
    unwritten). num_m: token blocks of the largest group (cdiv(its tokens, BLOCK_M))."""
    n, k = a.shape[1], a.shape[2]
    t = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    block_n = min(_pow2(n), 64)
    grid = len(slots) * num_m * triton.cdiv(n, block_n)
    _shrink(
        grid, x, a, t, sorted_tokens, starts, slots, k, n, x.stride(0), a.stride(0), a.stride(1), t.stride(0),
        num_m, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=64,
    )  # fmt: skip
    return t


def lora_expand(
    t: torch.Tensor,
    b: torch.Tensor,
    y: torch.Tensor,
    sorted_tokens: torch.Tensor,
    starts: torch.Tensor,
    slots: torch.Tensor,
    num_m: int,
    slice_starts: torch.Tensor,
    slice_sizes: torch.Tensor,
    max_slice: int,
) -> None:
    """y [num_tokens, out] += per slice s: t[:, s*R:(s+1)*R] @ b[slot, slice rows].T, in place, for grouped tokens."""
    rank = b.shape[2]
    block_n = 64
    num_n, num_slices = triton.cdiv(max_slice, block_n), len(slice_starts)
    grid = len(slots) * num_m * num_slices * num_n
    _expand(
        grid, t, b, y, sorted_tokens, starts, slots, slice_starts, slice_sizes, rank, t.stride(0), b.stride(0),
        b.stride(1), y.stride(0), num_m, NUM_N=num_n, NUM_SLICES=num_slices, BLOCK_M=BLOCK_M, BLOCK_N=block_n,
        BLOCK_R=_pow2(rank),
    )  # fmt: skip
