"""Grouped LoRA kernels (punica's SGMV layout): the step's tokens that use an adapter are sorted by its slot and cut
into blocks of at most BLOCK_M tokens of one slot; each program multiplies one block by that slot's weights.

shrink: t[p, tok, :] = x[tok, part p of in] @ A[slot, :, part p].T   A [max_loras, num_slices * rank, in]
expand: y[tok, slice s] += (sum over p of t[p, tok, s-th rank block]) @ B[slot, slice s rows].T
                                                    B [max_loras, out, rank]

The shrink splits the input features over SPLIT_K programs (a decode step has one or two token blocks: one program
each would run the whole K loop alone); each writes its partial sums (t float32 [SPLIT_K, num_tokens, N]) and the
expand adds them up as it reads them: no atomics, no zeroed buffer, two launches per layer.

The block table (lora/mapping.py) holds per block its first entry in the sorted tokens, its count and its slot;
blocks of count 0 do nothing, so CUDA graphs launch a fixed grid over a table refilled before each replay. Base-model
tokens (slot -1) are in no block and are left alone. The grids are one-dimensional (flattened) so that the launches
go through `Launch`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.launch import Launch


# SPLIT_K (the feature split) follows the step's token blocks: a runtime argument, so that steps of any size run the
# variants compiled at warm-up instead of compiling new ones mid-serving
@triton.jit(do_not_specialize=["SPLIT_K"])
def lora_shrink_kernel(
    x_ptr,  # [num_tokens, K]
    a_ptr,  # [max_loras, N, K]
    t_ptr,  # [SPLIT_K, num_tokens, N] float32
    sorted_ptr,  # [num_lora_tokens] token indices grouped by slot
    block_ptr,  # [3, >= num_blocks] per block: first entry in sorted, count, slot
    K,
    N,
    stride_xm,
    stride_al,
    stride_an,
    stride_tk,
    stride_tm,
    stride_blk,
    K_SPLIT,  # input features per program (a multiple of BLOCK_K)
    SPLIT_K,  # programs per token block and column block, each over K_SPLIT features
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,  # float32: no TF32 in tl.dot
):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_k = pid % SPLIT_K
    pid_n = (pid // SPLIT_K) % num_n
    pid_m = pid // (SPLIT_K * num_n)
    count = tl.load(block_ptr + stride_blk + pid_m)
    if count == 0:
        return
    first = tl.load(block_ptr + pid_m)
    slot = tl.load(block_ptr + 2 * stride_blk + pid_m).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
    tok = tl.load(sorted_ptr + first + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * K_SPLIT, tl.minimum(K, (pid_k + 1) * K_SPLIT), BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < K
        xs = tl.load(x_ptr + tok[:, None] * stride_xm + kk[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(
            a_ptr + slot * stride_al + offs_n[None, :] * stride_an + kk[:, None],
            mask=mask_k[:, None] & mask_n[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        if IEEE:  # float32 weights: full-precision products (tl.dot takes TF32 on the GPU otherwise)
            acc += tl.dot(xs, w, input_precision="ieee")
        else:
            acc += tl.dot(xs, w)
    t_ptrs = t_ptr + pid_k * stride_tk + tok[:, None] * stride_tm + offs_n[None, :]
    tl.store(t_ptrs, acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["SPLIT_K"])
def lora_expand_kernel(
    t_ptr,  # [SPLIT_K, num_tokens, num_slices * R] float32: the shrink's partial sums
    b_ptr,  # [max_loras, out, R]
    y_ptr,  # [num_tokens, out]
    sorted_ptr,
    block_ptr,
    slice_start_ptr,  # [num_slices] first output row of each slice
    slice_size_ptr,  # [num_slices]
    R,
    stride_tk,
    stride_tm,
    stride_bl,
    stride_bn,
    stride_ym,
    stride_blk,
    SPLIT_K,  # the shrink's parts to sum
    NUM_N: tl.constexpr,  # column blocks per slice (enough for the largest slice)
    NUM_SLICES: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_n = pid % NUM_N
    s = (pid // NUM_N) % NUM_SLICES
    pid_m = pid // (NUM_N * NUM_SLICES)
    count = tl.load(block_ptr + stride_blk + pid_m)
    n_size = tl.load(slice_size_ptr + s)
    if count == 0 or pid_n * BLOCK_N >= n_size:
        return
    first = tl.load(block_ptr + pid_m)
    slot = tl.load(block_ptr + 2 * stride_blk + pid_m).to(tl.int64)
    n_start = tl.load(slice_start_ptr + s)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
    tok = tl.load(sorted_ptr + first + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n_size
    cols = n_start + offs_n
    t_ptrs = t_ptr + tok[:, None] * stride_tm + s * R + offs_r[None, :]
    ts = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for p in range(SPLIT_K):
        ts += tl.load(t_ptrs + p * stride_tk, mask=mask_m[:, None] & mask_r[None, :], other=0.0)
    w = tl.load(
        b_ptr + slot * stride_bl + cols[None, :] * stride_bn + offs_r[:, None],
        mask=mask_r[:, None] & mask_n[None, :],
        other=0.0,
    )  # [BLOCK_R, BLOCK_N]
    if IEEE:
        acc = tl.dot(ts.to(w.dtype), w, input_precision="ieee")
    else:
        acc = tl.dot(ts.to(w.dtype), w)
    y_ptrs = y_ptr + tok[:, None] * stride_ym + cols[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


_shrink, _expand = Launch(lora_shrink_kernel), Launch(lora_expand_kernel)
BLOCK_M = 16  # tl.dot's smallest tile: decode groups are often a few tokens (lora/mapping.py's BLOCK_M)


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


def lora_shrink(
    x: torch.Tensor, a: torch.Tensor, sorted_tokens: torch.Tensor, blocks: torch.Tensor, num_blocks: int
) -> torch.Tensor:
    """x [num_tokens, in] (a's dtype), a [max_loras, N, in] -> t [split_k, num_tokens, N] float32: partial sums
    over split_k parts of the input features (rows of base tokens unwritten). blocks [3, >= num_blocks]: the block
    table (first, count, slot rows); the grid covers num_blocks. The features are split while the token and column
    blocks are under ~128 programs, in up to 32 parts (a power of two) of at least 256."""
    n, k = a.shape[1], a.shape[2]
    block_n, block_k = min(_pow2(n), 64), 64
    programs = num_blocks * triton.cdiv(n, block_n)
    split_k = max(1, min(triton.cdiv(k, 256), 32, triton.cdiv(128, programs)))
    split_k = 1 << (split_k.bit_length() - 1)  # a power of two: few compiled variants over the graphs' sizes
    k_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_split)
    rows = -(-x.shape[0] // 16) * 16  # t's stride(0) a multiple of 16 for any step: one compiled variant
    t = torch.empty(split_k, rows, n, dtype=torch.float32, device=x.device)[:, : x.shape[0]]
    _shrink(
        programs * split_k, x, a, t, sorted_tokens, blocks, k, n, x.stride(0), a.stride(0), a.stride(1), t.stride(0),
        t.stride(1), blocks.stride(0), k_split, split_k, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        IEEE=a.dtype == torch.float32,
    )  # fmt: skip
    return t


def lora_expand(
    t: torch.Tensor,
    b: torch.Tensor,
    y: torch.Tensor,
    sorted_tokens: torch.Tensor,
    blocks: torch.Tensor,
    num_blocks: int,
    slice_starts: torch.Tensor,
    slice_sizes: torch.Tensor,
    max_slice: int,
) -> None:
    """y [num_tokens, out] += per slice s: (t summed over its first dim)[:, s*R:(s+1)*R] @ b[slot, slice rows].T, in
    place, for blocked tokens. t: lora_shrink's [split_k, num_tokens, num_slices * R]."""
    rank = b.shape[2]
    block_n = 128
    num_n, num_slices = triton.cdiv(max_slice, block_n), len(slice_starts)
    grid = num_blocks * num_slices * num_n
    _expand(
        grid, t, b, y, sorted_tokens, blocks, slice_starts, slice_sizes, rank, t.stride(0), t.stride(1), b.stride(0),
        b.stride(1), y.stride(0), blocks.stride(0), t.shape[0], NUM_N=num_n, NUM_SLICES=num_slices,
        IEEE=b.dtype == torch.float32,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_R=_pow2(rank),
    )  # fmt: skip
