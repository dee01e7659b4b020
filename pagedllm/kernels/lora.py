"""Grouped LoRA kernels (punica's SGMV layout): the step's tokens that use an adapter are sorted by its slot and cut
into blocks of at most BLOCK_M tokens of one slot; each program multiplies one block by that slot's weights.

shrink: t[p, tok, :] = x[tok, part p of in] @ A[slot, :, part p].T   A [max_loras, num_slices * rank, in]
expand: y[tok, slice s] += (sum over p of t[p, tok, s-th rank block]) @ B[slot, slice s rows].T
                                                    B [max_loras, out, rank]

The shrink splits the input features over split_k programs (a decode step has one or two token blocks: one program
each would run the whole K loop alone); each writes its partial sums (t float32 [split_k, num_tokens, N]) and the
expand adds them up as it reads them: no atomics on data, no zeroed buffer.

Small steps (a few decode rows: `lora_fused`) run both in one launch: the programs take tickets in the order they
start; the first tickets do the shrink's parts, the others wait (spinning on a counter) until those are written and
then expand. A program only waits for programs that started before it, which never wait: no deadlock, however few
programs the GPU holds at once. The last program to finish zeroes the counters for the next launch.

The block table (lora/mapping.py) holds per block its first entry in the sorted tokens, its count and its slot;
blocks of count 0 do nothing, so CUDA graphs launch a fixed grid over a table refilled before each replay. Base-model
tokens (slot -1) are in no block and are left alone. The grids are one-dimensional (flattened) so that the launches
go through `Launch`.

Compiled variants: every argument that follows the step's token or block count (strides of the step's buffers, the
split, the mapping's addresses) is left unspecialized, so a layer has one compiled variant per kernel whatever the
step: Triton would otherwise compile another the first time a value is 1 or not a multiple of 16."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.launch import Launch

STEP_INTS = ["stride_tk", "stride_blk", "split_k", "K_SPLIT", "num_blocks"]  # follow the step: not specialized
STEP_PTRS = ["t_ptr", "sorted_ptr", "block_ptr"]  # the step's buffers: no alignment assumed


@triton.jit
def _block_tokens(block_ptr, sorted_ptr, stride_blk, pid_m, BLOCK_M: tl.constexpr):
    """Block pid_m of the table: (its token count, slot, token indices [BLOCK_M] (0 past the count)). The count, first
    entry and slot load together (no branch between them)."""
    count = tl.load(block_ptr + stride_blk + pid_m)
    first = tl.load(block_ptr + pid_m)
    slot = tl.load(block_ptr + 2 * stride_blk + pid_m).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    tok = tl.load(sorted_ptr + first + offs_m, mask=offs_m < count, other=0).to(tl.int64)
    return count, slot, tok


@triton.jit
def _sum_parts(t_ptrs, stride_tk, mask, num_parts, PARTS: tl.constexpr, CHUNK: tl.constexpr, CACHE: tl.constexpr):
    """The sum over p < num_parts of the tiles t_ptrs + p * stride_tk (mask: the tile's [BLOCK_M, BLOCK_R]), CHUNK
    parts a load: the loads are independent (all in flight at once) and each holds few registers."""
    ts = tl.zeros(t_ptrs.shape, dtype=tl.float32)
    offs_c = tl.arange(0, CHUNK)
    for p0 in tl.static_range(0, PARTS, CHUNK):
        p = p0 + offs_c
        ptrs = t_ptrs[None, :, :] + p[:, None, None] * stride_tk
        part = tl.load(ptrs, mask=(p < num_parts)[:, None, None] & mask[None, :, :], other=0.0, cache_modifier=CACHE)
        ts += tl.sum(part, axis=0)
    return ts


@triton.jit(do_not_specialize=STEP_INTS, do_not_specialize_on_alignment=STEP_PTRS)
def lora_shrink_kernel(
    x_ptr,  # [num_tokens, K]
    a_ptr,  # [max_loras, N, K]
    t_ptr,  # [split_k, num_tokens, N] float32
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
    split_k,  # programs per token block and column block, each over K_SPLIT features
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_k = pid % split_k
    pid_n = (pid // split_k) % num_n
    pid_m = pid // (split_k * num_n)
    count, slot, tok = _block_tokens(block_ptr, sorted_ptr, stride_blk, pid_m, BLOCK_M)
    if count == 0:
        return
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
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
        acc += tl.dot(xs, w)
    t_ptrs = t_ptr + pid_k * stride_tk + tok[:, None] * stride_tm + offs_n[None, :]
    tl.store(t_ptrs, acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=STEP_INTS, do_not_specialize_on_alignment=STEP_PTRS)
def lora_expand_kernel(
    t_ptr,  # [split_k, num_tokens, num_slices * R] float32: the shrink's partial sums
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
    split_k,  # partial sums to add up (at most MAX_SPLIT)
    NUM_N: tl.constexpr,  # column blocks per slice (enough for the largest slice)
    NUM_SLICES: tl.constexpr,
    MAX_SPLIT: tl.constexpr,  # >= split_k, a power of two
    CHUNK: tl.constexpr,  # partial sums a load (a power of two, <= MAX_SPLIT)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_n = pid % NUM_N
    s = (pid // NUM_N) % NUM_SLICES
    pid_m = pid // (NUM_N * NUM_SLICES)
    count, slot, tok = _block_tokens(block_ptr, sorted_ptr, stride_blk, pid_m, BLOCK_M)
    n_size = tl.load(slice_size_ptr + s)
    n_start = tl.load(slice_start_ptr + s)
    if count == 0 or pid_n * BLOCK_N >= n_size:
        return
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n_size
    cols = n_start + offs_n
    t_ptrs = t_ptr + tok[:, None] * stride_tm + s * R + offs_r[None, :]
    t_mask = mask_m[:, None] & mask_r[None, :]
    ts = _sum_parts(t_ptrs, stride_tk, t_mask, split_k, MAX_SPLIT, CHUNK, "")  # [BLOCK_M, BLOCK_R]
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


@triton.jit(do_not_specialize=STEP_INTS, do_not_specialize_on_alignment=STEP_PTRS)
def lora_fused_kernel(
    x_ptr,  # [num_tokens, K]
    a_ptr,  # [max_loras, NUM_SLICES * R, K]
    b_ptr,  # [max_loras, out, R]
    y_ptr,  # [num_tokens, out]
    t_ptr,  # [SPLIT_K, num_tokens, NUM_SLICES * R] float32: the shrink's partial sums
    sorted_ptr,
    block_ptr,
    slice_start_ptr,
    slice_size_ptr,
    sync_ptr,  # [3] int32, zero between launches: tickets taken, shrink parts written, programs finished
    K,
    R,
    stride_xm,
    stride_al,
    stride_an,
    stride_bl,
    stride_bn,
    stride_ym,
    stride_tk,
    stride_tm,
    stride_blk,
    num_blocks,
    K_PART: tl.constexpr,  # input features per shrink part (a multiple of BLOCK_K)
    NUM_N: tl.constexpr,  # column blocks per slice
    NUM_SLICES: tl.constexpr,
    SPLIT_K: tl.constexpr,  # shrink parts per token block
    BLOCK_P: tl.constexpr,  # >= SPLIT_K (a power of two)
    CHUNK: tl.constexpr,  # partial sums a load (a power of two, <= BLOCK_P)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_S: tl.constexpr,  # >= NUM_SLICES * R: the shrink's columns
    BLOCK_R: tl.constexpr,
):
    num_shrink = num_blocks * SPLIT_K
    per_block = NUM_SLICES * NUM_N  # expand programs per block
    # programs mostly start in grid order (ticket == program id): read that role's block while the ticket comes
    pid = tl.program_id(0)
    guess_m = tl.where(pid < num_shrink, pid // SPLIT_K, (pid - num_shrink) // per_block)
    count, slot, tok = _block_tokens(block_ptr, sorted_ptr, stride_blk, guess_m, BLOCK_M)
    ticket = tl.atomic_add(sync_ptr, 1, sem="relaxed")  # this program's role, in the order programs start
    pid_m = tl.where(ticket < num_shrink, ticket // SPLIT_K, (ticket - num_shrink) // per_block)
    if pid_m != guess_m:
        count, slot, tok = _block_tokens(block_ptr, sorted_ptr, stride_blk, pid_m, BLOCK_M)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
    if ticket < num_shrink:  # shrink part pid_k of block pid_m: t[pid_k, tok, :] = x[tok, part] @ A[slot, :, part].T
        pid_k = ticket % SPLIT_K
        if count > 0:
            offs_s = tl.arange(0, BLOCK_S)
            mask_s = offs_s < NUM_SLICES * R
            offs_k = tl.arange(0, BLOCK_K)
            acc = tl.zeros((BLOCK_M, BLOCK_S), dtype=tl.float32)
            for k0 in range(0, K_PART, BLOCK_K):
                kk = pid_k * K_PART + k0 + offs_k
                mask_k = kk < K
                xs = tl.load(
                    x_ptr + tok[:, None] * stride_xm + kk[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0
                )
                w = tl.load(
                    a_ptr + slot * stride_al + offs_s[None, :] * stride_an + kk[:, None],
                    mask=mask_k[:, None] & mask_s[None, :],
                    other=0.0,
                )  # [BLOCK_K, BLOCK_S]
                acc += tl.dot(xs, w)
            t_ptrs = t_ptr + pid_k * stride_tk + tok[:, None] * stride_tm + offs_s[None, :]
            tl.store(t_ptrs, acc, mask=mask_m[:, None] & mask_s[None, :])
        tl.debug_barrier()  # every thread's stores before the release
        tl.atomic_add(sync_ptr + 1, 1, sem="release")
    else:  # column block pid_n of slice s of block pid_m: y[tok, cols] += (sum of t's parts) @ B[slot, cols].T
        e = ticket - num_shrink
        pid_n = e % NUM_N
        s = (e // NUM_N) % NUM_SLICES
        n_size = tl.load(slice_size_ptr + s)
        n_start = tl.load(slice_start_ptr + s)
        if count > 0 and pid_n * BLOCK_N < n_size:
            offs_r = tl.arange(0, BLOCK_R)
            mask_r = offs_r < R
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_n = offs_n < n_size
            cols = n_start + offs_n
            w = tl.load(
                b_ptr + slot * stride_bl + cols[None, :] * stride_bn + offs_r[:, None],
                mask=mask_r[:, None] & mask_n[None, :],
                other=0.0,
            )  # [BLOCK_R, BLOCK_N], read while the shrink runs
            y_ptrs = y_ptr + tok[:, None] * stride_ym + cols[None, :]
            mask = mask_m[:, None] & mask_n[None, :]
            y = tl.load(y_ptrs, mask=mask, other=0.0)
            while tl.load(sync_ptr + 1, volatile=True) < num_shrink:  # the shrink's parts (earlier tickets)
                pass
            done = tl.atomic_add(sync_ptr + 1, 0, sem="acquire")  # their stores are visible from here on
            tl.debug_barrier()
            t_ptrs = t_ptr + tok[:, None] * stride_tm + s * R + offs_r[None, :]
            t_mask = mask_m[:, None] & mask_r[None, :] & (done >= num_shrink)
            ts = _sum_parts(t_ptrs, stride_tk, t_mask, SPLIT_K, BLOCK_P, CHUNK, ".cg")  # [BLOCK_M, BLOCK_R]
            acc = tl.dot(ts.to(w.dtype), w)
            tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)
    finished = tl.atomic_add(sync_ptr + 2, 1, sem="acq_rel")
    if finished == num_shrink + num_blocks * per_block - 1:  # the last program: counters back to zero
        offs = tl.arange(0, 4)
        tl.store(sync_ptr + offs, tl.zeros((4,), dtype=tl.int32), mask=offs < 3)


_shrink, _expand, _fused = Launch(lora_shrink_kernel), Launch(lora_expand_kernel), Launch(lora_fused_kernel)
BLOCK_M = 16  # tl.dot's smallest tile: decode groups are often a few tokens (lora/mapping.py's BLOCK_M)
MAX_SPLIT = 32  # the shrink's most parts
PART_ELEMENTS = 8192  # the expand reads its partial sums in loads of at most this many elements (64 a thread)


def _chunk(parts: int, block_r: int) -> int:
    """Partial sums per load of the expand: all of them where [parts, BLOCK_M, block_r] is small."""
    return max(1, min(parts, PART_ELEMENTS // (BLOCK_M * block_r)))


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


def max_split(k: int) -> int:
    """The most parts the shrink splits k input features into: parts of at least 256, a power of two, <= 32."""
    return 1 << (min(triton.cdiv(k, 256), MAX_SPLIT).bit_length() - 1)


def _split(k: int, split_k: int, block_k: int) -> tuple[int, int]:
    """(features per part, a multiple of block_k; parts) of k features cut in about split_k parts."""
    k_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    return k_split, triton.cdiv(k, k_split)


def lora_shrink(
    x: torch.Tensor, a: torch.Tensor, sorted_tokens: torch.Tensor, blocks: torch.Tensor, num_blocks: int
) -> torch.Tensor:
    """x [num_tokens, in] (a's dtype), a [max_loras, N, in] -> t [split_k, num_tokens, N] float32: partial sums
    over split_k parts of the input features (rows of base tokens unwritten). blocks [3, >= num_blocks]: the block
    table (first, count, slot rows); the grid covers num_blocks. The features are split while the token and column
    blocks are under ~128 programs, in up to max_split(in) parts (a power of two) of at least 256."""
    n, k = a.shape[1], a.shape[2]
    block_n, block_k = min(_pow2(n), 64), 64
    programs = num_blocks * triton.cdiv(n, block_n)
    split_k = max(1, min(max_split(k), triton.cdiv(128, programs)))
    k_split, split_k = _split(k, 1 << (split_k.bit_length() - 1), block_k)
    t = torch.empty(split_k, x.shape[0], n, dtype=torch.float32, device=x.device)
    _shrink(
        programs * split_k, x, a, t, sorted_tokens, blocks, k, n, x.stride(0), a.stride(0), a.stride(1), t.stride(0),
        t.stride(1), blocks.stride(0), k_split, split_k, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
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
    max_parts: int = MAX_SPLIT,
) -> None:
    """y [num_tokens, out] += per slice s: (t summed over its first dim)[:, s*R:(s+1)*R] @ b[slot, slice rows].T, in
    place, for blocked tokens. t: lora_shrink's [split_k, num_tokens, num_slices * R]; max_parts: a power of two
    >= split_k for every step of the layer (max_split(in)), the same each call (it is compiled in)."""
    rank = b.shape[2]
    block_n = 128
    assert t.shape[0] <= max_parts, "more split parts than the expand reads"
    num_n, num_slices = triton.cdiv(max_slice, block_n), len(slice_starts)
    grid = num_blocks * num_slices * num_n
    _expand(
        grid, t, b, y, sorted_tokens, blocks, slice_starts, slice_sizes, rank, t.stride(0), t.stride(1), b.stride(0),
        b.stride(1), y.stride(0), blocks.stride(0), t.shape[0], NUM_N=num_n, NUM_SLICES=num_slices,
        MAX_SPLIT=max_parts, CHUNK=_chunk(max_parts, _pow2(rank)), BLOCK_M=BLOCK_M, BLOCK_N=block_n,
        BLOCK_R=_pow2(rank),
    )  # fmt: skip


def lora_fused(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    y: torch.Tensor,
    sorted_tokens: torch.Tensor,
    blocks: torch.Tensor,
    num_blocks: int,
    slice_starts: torch.Tensor,
    slice_sizes: torch.Tensor,
    max_slice: int,
    sync: torch.Tensor,
) -> None:
    """lora_shrink then lora_expand in one launch: y [num_tokens, out] += the blocked tokens' x [num_tokens, in] @
    A[slot].T @ B[slot].T per slice, in place. For steps of a few tokens, where the two launches' fixed costs
    outweigh their work. sync: int32 [3] zeros, this layer's own (the launches of one layer must not overlap)."""
    n, k, rank = a.shape[1], a.shape[2], b.shape[2]
    block_k, block_n = 128, 256
    k_split, split_k = _split(k, max_split(k), block_k)
    num_n, num_slices = triton.cdiv(max_slice, block_n), len(slice_starts)
    t = torch.empty(split_k, x.shape[0], n, dtype=torch.float32, device=x.device)
    grid = num_blocks * (split_k + num_slices * num_n)
    _fused(
        grid, x, a, b, y, t, sorted_tokens, blocks, slice_starts, slice_sizes, sync, k, rank, x.stride(0),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), y.stride(0), t.stride(0), t.stride(1), blocks.stride(0),
        num_blocks, K_PART=k_split, NUM_N=num_n, NUM_SLICES=num_slices, SPLIT_K=split_k, BLOCK_P=_pow2(split_k, 1),
        CHUNK=_chunk(_pow2(split_k, 1), _pow2(rank)),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_S=_pow2(n), BLOCK_R=_pow2(rank),
    )  # fmt: skip
