"""W4A16 / W8A16 GEMV for decode batches (M <= GEMV_MAX_M rows), on the K-packed weights of int_packing.py: qweight
int32 [ceil(K / pack), N], scales [num_groups, N] float32, zeros [num_groups, N] float32 or none (the midpoint
2**(bits - 1)), or a 2**bits-entry codebook (w = codebook[q] * scale, bitsandbytes' nf4 / fp4).

At M = 1 a linear reads 0.5 byte of weight per multiply-add: the kernel must unpack and dequantize at memory speed
with few instructions per value, so it runs on the CUDA cores (float32 FMA), not the tensor cores:
- each program loads a [BLOCK_K / pack, BLOCK_N] tile of packed words once (rows of N-contiguous words), and takes
  value j of every word with one and-or: the value's bits masked in place under the exponent of 2**23 make the
  float32 2**23 + q * 2**(bits * j), and subtracting 2**23 + zero * 2**(bits * j) leaves (q - zero) * 2**(bits * j)
  exactly (the upper half word is shifted down first, so no value passes bit 23); the factor 2**(bits * j) comes
  out of per-position sums at M = 1 and out of the activations (scaled by 2**-(bits * j)) for more rows;
- one scale row per K step (BLOCK_K divides the group size): the dot products of a step are summed unscaled and
  multiplied by the group's scale once per output;
- K is split over programs so that every SM is busy; the float32 partials [S, M, N] are summed in the order
  s = 0, 1, ... (bit-reproducible) by the last program of each column block to finish (an integer arrival counter,
  reset by that program), so a linear is one launch; FUSED_REDUCE = False sums them in fp8_gemv's reduce kernel;
- the tiles (BLOCK_N, BLOCK_K, warps, K splits, pipeline stages) come per batch bucket and weight shape from TABLE
  (filled from the bench's --sweep), else from CONFIGS; with stages > 1 the packed words of the next steps stream
  into shared memory asynchronously while a step computes.

Group sizes that no K step divides (and K steps that straddle groups) take a per-value gather of scales and zeros.
One bfloat16 row of 4-bit weights (one group per step) takes wna16_pairs.py's step instead: two values per bf16x2
instruction, products and 4-term sums rounded to bfloat16 (PAIRS = False: the float32 path). The kernel takes part
in programmatic dependent launch (kernels/__init__.py: pdl)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedllm.kernels import pdl
from pagedllm.layers.quantization.fp8_gemv import sm_count, split_k_reduce_kernel
from pagedllm.layers.quantization.fp8_ops import triton
from pagedllm.layers.quantization.wna16_pairs import pairs_apply, pairs_mode

# Batches up to this many rows take the GEMV. Per 4-bit value: one and-or, one add, then M FMAs and the activation
# loads; an H100 issues about 4.4 instructions per value at full memory speed, so M = 1 (about 3.4, compiled) runs near
# the weight read, M = 4 at about half of it, and M = 8 (about 22) near bf16's time: there, the tensor cores.
GEMV_MAX_M = 4
# per BLOCK_M (M rounded up to 1, 2, 4, 8): (BLOCK_N output columns per program, BLOCK_K input features per step
# (4-bit; half as many at 8 bits), warps, programs wanted per SM before K stops being split). BLOCK_N >= 4 * 32 *
# warps keeps a step's K rows in each thread (no shuffles); larger BLOCK_N reuses each activation over more columns;
# the ones here compile for sm_90 without spilling registers. The default for shapes TABLE lacks.
CONFIGS = {1: (256, 128, 2, 4), 2: (256, 64, 2, 4), 4: (512, 16, 2, 4), 8: (256, 16, 2, 4)}
# (bits, BLOCK_M, N, K, act order) -> GemvConfig's fields but the first (block_n, block_k, warps, splits, stages):
# per-shape tiles from `benchmarks/wna16_gemv_bench.py --sweep` (it prints this literal). An act-order shape not
# here takes its plain entry
# measured on an H100 80GB HBM3 (benchmarks/wna16_gemv_bench.py --sweep): Llama-3.1-8B's layer shapes, group 128
TABLE: dict[tuple[int, int, int, int, bool], tuple[int, int, int, int, int]] = {
    (4, 1, 6144, 4096, False): (256, 64, 2, 32, 1),
    (4, 2, 6144, 4096, False): (128, 64, 1, 22, 2),
    (4, 4, 6144, 4096, False): (128, 16, 1, 22, 4),
    (4, 1, 6144, 4096, True): (256, 64, 2, 32, 1),
    (4, 1, 4096, 4096, False): (256, 64, 2, 32, 1),
    (4, 2, 4096, 4096, False): (128, 64, 1, 32, 2),
    (4, 4, 4096, 4096, False): (256, 16, 2, 32, 4),
    (4, 1, 4096, 4096, True): (256, 128, 2, 32, 1),
    (4, 1, 28672, 4096, False): (256, 64, 2, 10, 1),
    (4, 2, 28672, 4096, False): (256, 32, 1, 10, 2),
    (4, 4, 28672, 4096, False): (512, 16, 2, 19, 2),
    (4, 1, 28672, 4096, True): (512, 64, 2, 10, 2),
    (4, 1, 4096, 14336, False): (256, 64, 2, 56, 1),
    (4, 2, 4096, 14336, False): (128, 64, 1, 32, 2),
    (4, 4, 4096, 14336, False): (128, 16, 1, 32, 4),
    (4, 1, 4096, 14336, True): (256, 64, 2, 32, 2),
}
SWEEP_TILES = ((128, 1), (256, 2), (256, 1), (512, 2))  # (BLOCK_N, warps) of the sweep: 4 or 8 columns a thread
SWEEP_STAGES = (1, 2, 4)
# codebook weights (nf4 / fp4) too: their table lookups are a gather per value, which Triton lays out across threads
# (shuffles), so the tensor-core kernel may be as fast; the bench's --codebook decides
CODEBOOK_GEMV = True
# act order: the GEMV reads x through the permutation (its loads then gathers) instead of a gather launch first
PERM_IN_KERNEL = True
PAIRS = True  # M = 1, 4-bit, bfloat16: the bf16x2 step of wna16_pairs.py (False: the float32 path everywhere)
FUSED_REDUCE = True  # the last program of a column block sums the K splits (else: a second launch)
MAX_COUNTERS = 1 << 14  # arrival counters per device (column blocks of one launch)

MAGIC = 0x4B000000  # the float32 bits of 2**23
_counters: dict[torch.device, torch.Tensor] = {}

if triton is not None:
    import triton.language as tl

    from pagedllm.kernels.fused_ops import wait_previous_kernel
    from pagedllm.layers.quantization.wna16_pairs import pairs_step

    @triton.jit
    def values_of(
        src, z, cb_ptr, s_ptr, z_ptr, k, offs_n, mask_n, N, K, group_size, magic,
        POS: tl.constexpr, BITS: tl.constexpr, HAS_ZP: tl.constexpr, ONE_GROUP: tl.constexpr, CODEBOOK: tl.constexpr,
    ):  # fmt: skip
        """The values at position POS of the words src [ROWS, BLOCK_N] (input features k [ROWS]) as float32. One group
        per step: (q - zero) * 2**(BITS * POS), or codebook[q]; else the weight itself, each value scaled by its own
        group's scale (a gather)."""
        if ONE_GROUP and not CODEBOOK:
            # 2**23 + q * 2**(BITS * POS) minus 2**23 + zero * 2**(BITS * POS): exactly (q - zero) * 2**(BITS * POS)
            biased = ((src & (((1 << BITS) - 1) << (BITS * POS))) | magic).to(tl.float32, bitcast=True)
            v = biased - (8388608.0 + z * (1 << (BITS * POS)))[None, :]
        else:
            code = (src >> (BITS * POS)) & ((1 << BITS) - 1)
            if CODEBOOK:
                v = tl.load(cb_ptr + code)  # a 2**BITS-entry table: cache hits
            else:
                v = code.to(tl.float32)
            if not ONE_GROUP:
                gk = (k // group_size)[:, None] * N + offs_n[None, :]
                mask = (k < K)[:, None] & mask_n[None, :]
                if HAS_ZP:
                    v -= tl.load(z_ptr + gk, mask=mask, other=0.0)
                elif not CODEBOOK:
                    v -= 1 << (BITS - 1)
                v *= tl.load(s_ptr + gk, mask=mask, other=0.0)
        return v

    @triton.jit
    def row_dot(x_ptrs, offset, limit, k, K, v, x_scale, MASKED: tl.constexpr, FIRST: tl.constexpr):
        """sum over the step's rows of x * x_scale * v [ROWS, BLOCK_N] -> [BLOCK_N], x [ROWS] the activations of one
        row at x_ptrs + offset (its index times the row stride), zeros where offset >= limit (past M) unless FIRST
        (row 0: always there)."""
        if MASKED:
            x = tl.load(x_ptrs + offset, mask=(k < K) & (offset < limit), other=0.0)
        elif FIRST:
            x = tl.load(x_ptrs + offset)
        else:
            x = tl.load(x_ptrs + offset, mask=offset < limit, other=0.0)
        return tl.sum((x.to(tl.float32) * x_scale)[:, None] * v, axis=0)

    @triton.jit
    def gemv_step(
        x_ptr, qw_ptr, s_ptr, z_ptr, cb_ptr, perm_ptr, start, offs_m, offs_n, mask_n, M, N, K, group_size, stride_xm,
        magic, sixteen,
        BITS: tl.constexpr, HAS_ZP: tl.constexpr, ONE_GROUP: tl.constexpr, CODEBOOK: tl.constexpr, PERM: tl.constexpr,
        MASKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PAIRS: tl.constexpr,
    ):  # fmt: skip
        """sum over k in [start, start + BLOCK_K) of x[m, k] * w[k, n] -> [BLOCK_M, BLOCK_N] float32, unscaled
        (w / scale of the step's group) when ONE_GROUP, else scaled. MASKED: the step may pass K (else no K masks,
        so the activation loads take constant offsets). magic = 0x4B000000 and sixteen = 16 come as arguments, not
        literals: with a literal magic the and-or takes two instructions (two immediates), and with a literal shift
        the compiler rewrites each use of the high half into its own shift. Rows of x: one accumulator each
        (a [BLOCK_M, ROWS, BLOCK_N] product would spill). PAIRS: wna16_pairs' bf16x2 step (2: its emulation)."""
        if PAIRS != 0:
            return pairs_step(
                x_ptr, qw_ptr, z_ptr, start, offs_n, mask_n, N, K, group_size, HAS_ZP, MASKED, BLOCK_N, BLOCK_K,
                PAIRS == 2,
            )[None, :]  # fmt: skip
        PACK: tl.constexpr = 32 // BITS
        HALF: tl.constexpr = PACK // 2  # values per 16-bit half word: in place under the float32 exponent
        ROWS: tl.constexpr = BLOCK_K // PACK
        IN_PLACE: tl.constexpr = ONE_GROUP and not CODEBOOK
        offs_r = tl.arange(0, ROWS)
        w_ptrs = qw_ptr + (start // PACK) * N + (offs_r[:, None] * N + offs_n[None, :])  # [ROWS, BLOCK_N]
        if MASKED:
            words = tl.load(w_ptrs, mask=(start + offs_r * PACK < K)[:, None] & mask_n[None, :], other=0)
        else:
            words = tl.load(w_ptrs, mask=mask_n[None, :], other=0)  # [ROWS, BLOCK_N] int32
        high = words >> sixteen  # values HALF..PACK-1 at bits [0, 16)
        z = tl.full((BLOCK_N,), 1 << (BITS - 1), tl.float32)
        if ONE_GROUP and HAS_ZP:
            z = tl.load(z_ptr + (start // group_size) * N + offs_n, mask=mask_n, other=0.0)  # [BLOCK_N]
        # M = 1 and IN_PLACE: the sums of value position i = j % HALF apart (t_i, in units of 2**-(BITS * i)),
        # scaled once at the end; more rows: x scaled by 2**-(BITS * i) instead, a_m the sum of row m
        t0 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        t1, t2, t3 = t0, t0, t0
        a0, a1, a2, a3, a4, a5, a6, a7 = t0, t0, t0, t0, t0, t0, t0, t0
        for j in tl.static_range(PACK):
            k = start + offs_r * PACK + j  # [ROWS] input feature of value j of each word
            v = values_of(
                words if j < HALF else high, z, cb_ptr, s_ptr, z_ptr, k, offs_n, mask_n, N, K, group_size, magic,
                j % HALF, BITS, HAS_ZP, ONE_GROUP, CODEBOOK,
            )  # fmt: skip
            if PERM and MASKED:  # act order: the weight's row k holds input feature perm[k]
                x_ptrs = x_ptr + tl.load(perm_ptr + k, mask=k < K, other=0)
            elif PERM:
                x_ptrs = x_ptr + tl.load((perm_ptr + start) + (offs_r * PACK + j))
            else:  # the step's base pointer, then constant offsets (the loads take them as immediates)
                x_ptrs = (x_ptr + start) + (offs_r * PACK + j)
            if BLOCK_M == 1:
                d = row_dot(x_ptrs, 0, M, k, K, v, 1.0, MASKED, True)
                if not IN_PLACE or j % HALF == 0:
                    t0 += d
                elif j % HALF == 1:
                    t1 += d
                elif j % HALF == 2:
                    t2 += d
                else:
                    t3 += d
            else:
                x_scale = 1.0 / (1 << (BITS * (j % HALF) * IN_PLACE))
                a0 += row_dot(x_ptrs, 0, M, k, K, v, x_scale, MASKED, True)
                a1 += row_dot(x_ptrs, stride_xm, M * stride_xm, k, K, v, x_scale, MASKED, False)
                if BLOCK_M > 2:
                    a2 += row_dot(x_ptrs, 2 * stride_xm, M * stride_xm, k, K, v, x_scale, MASKED, False)
                    a3 += row_dot(x_ptrs, 3 * stride_xm, M * stride_xm, k, K, v, x_scale, MASKED, False)
                if BLOCK_M > 4:
                    a4 += row_dot(x_ptrs, 4 * stride_xm, M * stride_xm, k, K, v, x_scale, MASKED, False)
                    a5 += row_dot(x_ptrs, 5 * stride_xm, M * stride_xm, k, K, v, x_scale, MASKED, False)
                    a6 += row_dot(x_ptrs, 6 * stride_xm, M * stride_xm, k, K, v, x_scale, MASKED, False)
                    a7 += row_dot(x_ptrs, 7 * stride_xm, M * stride_xm, k, K, v, x_scale, MASKED, False)
        if BLOCK_M == 1:
            if IN_PLACE:  # powers of two: exact
                unit: tl.constexpr = 1.0 / (1 << BITS)
                t0 += t1 * unit + t2 * (unit * unit) + t3 * (unit * unit * unit)
            return t0[None, :]
        rows = offs_m[:, None]  # [BLOCK_M, 1]
        t = tl.where(rows == 0, a0[None, :], a1[None, :])
        if BLOCK_M > 2:
            t = tl.where(rows == 2, a2[None, :], tl.where(rows == 3, a3[None, :], t))
        if BLOCK_M > 4:
            t = tl.where(rows == 4, a4[None, :], tl.where(rows == 5, a5[None, :], t))
            t = tl.where(rows == 6, a6[None, :], tl.where(rows == 7, a7[None, :], t))
        return t

    @triton.jit
    def scale_step(acc, t, s_ptr, start, offs_n, mask_n, N, group_size, ONE_GROUP: tl.constexpr):
        """acc + the step's sums t [BLOCK_M, BLOCK_N]: times its group's scale once per output when ONE_GROUP."""
        if ONE_GROUP:
            return acc + t * tl.load(s_ptr + (start // group_size) * N + offs_n, mask=mask_n, other=0.0)[None, :]
        return acc + t

    # M only bounds masks: one compiled variant per BLOCK_M
    @triton.jit(do_not_specialize=["M", "magic", "sixteen"])
    def wna16_gemv_kernel(
        x_ptr, qw_ptr, s_ptr, z_ptr, cb_ptr, perm_ptr, bias_ptr, part_ptr, out_ptr, cnt_ptr, M, N, K, group_size,
        k_split, stride_xm, magic, sixteen,
        BITS: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, ONE_GROUP: tl.constexpr,
        CODEBOOK: tl.constexpr, PERM: tl.constexpr, SPLIT: tl.constexpr, FUSED: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
        UNROLL: tl.constexpr, PAIRS: tl.constexpr, USE_PDL: tl.constexpr,
    ):  # fmt: skip
        """Program (n, s): the columns of block n summed over K split s. One split (SPLIT false): out [M, N] =
        x @ W + bias in out's dtype. Else part [S, M, N] float32 takes the partial sums; with FUSED the last program
        of column block n to arrive (counter cnt[n]) writes out = sum over s in order + bias and resets cnt[n].
        The whole steps of a split run in a loop without masks on K, STAGES steps of packed words in flight (loaded
        asynchronously through shared memory; 1: each step's loads issued when the step starts); a step past K's
        end (the last split's, when BLOCK_K does not divide K) runs after it with masks. PAIRS: see gemv_step;
        USE_PDL: see kernels/__init__.py (pdl)."""
        wait_previous_kernel(USE_PDL)
        pid_n, pid_s = tl.program_id(0), tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m, mask_n = offs_m < M, offs_n < N
        mask = mask_m[:, None] & mask_n[None, :]
        k_lo = pid_s * k_split
        k_hi = tl.minimum(k_lo + k_split, K)
        k_even = k_lo + (k_hi - k_lo) // BLOCK_K * BLOCK_K  # whole steps; past it a masked one (K's end)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if STAGES == 1:  # the masked step inside the loop (fewer registers than peeling it: more programs per SM)
            for start in range(k_lo, k_hi, BLOCK_K):
                if start < k_even:
                    t = gemv_step(
                        x_ptr, qw_ptr, s_ptr, z_ptr, cb_ptr, perm_ptr, start, offs_m, offs_n, mask_n, M, N, K,
                        group_size, stride_xm, magic, sixteen, BITS, HAS_ZP, ONE_GROUP, CODEBOOK, PERM, False, BLOCK_M,
                        BLOCK_N, BLOCK_K, PAIRS,
                    )  # fmt: skip
                else:
                    t = gemv_step(
                        x_ptr, qw_ptr, s_ptr, z_ptr, cb_ptr, perm_ptr, start, offs_m, offs_n, mask_n, M, N, K,
                        group_size, stride_xm, magic, sixteen, BITS, HAS_ZP, ONE_GROUP, CODEBOOK, PERM, True, BLOCK_M,
                        BLOCK_N, BLOCK_K, PAIRS,
                    )  # fmt: skip
                acc = scale_step(acc, t, s_ptr, start, offs_n, mask_n, N, group_size, ONE_GROUP)
        else:  # no branch in the loop body: the compiler pipelines its loads
            for start in tl.range(k_lo, k_even, BLOCK_K, num_stages=STAGES):
                t = gemv_step(
                    x_ptr, qw_ptr, s_ptr, z_ptr, cb_ptr, perm_ptr, start, offs_m, offs_n, mask_n, M, N, K,
                    group_size, stride_xm, magic, sixteen, BITS, HAS_ZP, ONE_GROUP, CODEBOOK, PERM, False, BLOCK_M,
                    BLOCK_N, BLOCK_K, PAIRS,
                )  # fmt: skip
                acc = scale_step(acc, t, s_ptr, start, offs_n, mask_n, N, group_size, ONE_GROUP)
            if k_even < k_hi:
                t = gemv_step(
                    x_ptr, qw_ptr, s_ptr, z_ptr, cb_ptr, perm_ptr, k_even, offs_m, offs_n, mask_n, M, N, K,
                    group_size, stride_xm, magic, sixteen, BITS, HAS_ZP, ONE_GROUP, CODEBOOK, PERM, True, BLOCK_M,
                    BLOCK_N, BLOCK_K, PAIRS,
                )  # fmt: skip
                acc = scale_step(acc, t, s_ptr, k_even, offs_n, mask_n, N, group_size, ONE_GROUP)
        ptrs = offs_m[:, None] * N + offs_n[None, :]  # [BLOCK_M, BLOCK_N] offsets in an [M, N] matrix
        if SPLIT:
            tl.store(part_ptr + pid_s * M * N + ptrs, acc, mask=mask)
            if FUSED:
                tl.debug_barrier()  # every thread's partials stored before the counter releases them
                splits = tl.num_programs(1)
                if tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu") == splits - 1:
                    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                    # fixed order s = 0, 1, ...: the same sum whichever program came last; UNROLL loads in flight
                    # (the splits past the last add zeros: exact)
                    for s0 in range(0, splits, UNROLL):
                        for i in tl.static_range(UNROLL):
                            acc += tl.load(
                                part_ptr + (s0 + i) * M * N + ptrs, mask=mask & (s0 + i < splits), other=0.0,
                                cache_modifier=".cg",
                            )  # fmt: skip
                    if HAS_BIAS:
                        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
                    tl.store(out_ptr + ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
                    tl.atomic_xchg(cnt_ptr + pid_n, 0)  # ready for the next launch
        else:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def block_k_for(group_size: int, bits: int, k: int, block_k: int) -> tuple[int, bool]:
    """(BLOCK_K, one group per K step): block_k for one group over all of K, else the largest of block_k,
    block_k / 2, ... (at least two packed words) that divides the group size, else block_k with a per-value gather."""
    if group_size >= k:
        return block_k, True
    step = block_k
    while step >= 2 * (32 // bits):
        if group_size % step == 0:
            return step, True
        step //= 2
    return block_k, False


def plan_splits(n: int, k: int, block_n: int, block_k: int, programs_per_sm: int, sms: int) -> tuple[int, int]:
    """(number of K splits, K per split: a multiple of block_k) for about programs_per_sm programs per SM."""
    chunks = triton.cdiv(k, block_k)
    grid_n = triton.cdiv(n, block_n)
    return split_k(k, block_k, max(1, min(chunks, triton.cdiv(programs_per_sm * sms, grid_n))))


def split_k(k: int, block_k: int, want: int) -> tuple[int, int]:
    """(number of K splits, K per split: whole steps of block_k) for at most `want` splits, none of them empty."""
    k_split = triton.cdiv(triton.cdiv(k, block_k), max(1, want)) * block_k
    return triton.cdiv(k, k_split), k_split


class GemvConfig(NamedTuple):
    """One launch's tiles: BLOCK_M, BLOCK_N, BLOCK_K (in the weight's bits: what a step reads), warps, K splits and
    K per split, steps in flight (1: no pipelining), one group per step (else per-value scale gathers)."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    splits: int
    k_split: int
    stages: int
    one_group: bool


def block_m_for(m: int) -> int:
    return 1 if m == 1 else (2 if m == 2 else (4 if m <= 4 else 8))


def gemv_config(m: int, n: int, k: int, bits: int, group_size: int, act_order: bool, sms: int) -> GemvConfig:
    """The tiles for x [m, k] @ W [k, n]: TABLE's entry for the shape (an act-order shape falls back to its plain
    one), else CONFIGS' for the batch with K split to fill the SMs. BLOCK_K shrinks to divide the group size."""
    block_m = block_m_for(m)
    entry = TABLE.get((bits, block_m, n, k, act_order)) or TABLE.get((bits, block_m, n, k, False))
    if entry is not None:
        block_n, max_block_k, warps, want, stages = entry
        # (entries count BLOCK_K in 4-bit values, as CONFIGS do)
        block_k, one_group = block_k_for(group_size, bits, k, max_block_k * 4 // bits)
        splits, k_split = split_k(k, block_k, want)
    else:
        block_n, max_block_k, warps, programs_per_sm = CONFIGS[block_m]
        block_k, one_group = block_k_for(group_size, bits, k, max_block_k * 4 // bits)
        splits, k_split = plan_splits(n, k, block_n, block_k, programs_per_sm, sms)
        stages = 1
    return GemvConfig(block_m, block_n, block_k, warps, splits, k_split, stages, one_group)


def sweep_tiles(block_m: int) -> list[tuple[int, int, int, int]]:
    """The (BLOCK_N, BLOCK_K, warps, stages) the bench's --sweep times (with a few K splits each) and the kernel
    tests run: every thread keeps a step's K rows of 4 or 8 columns (BLOCK_N = 128 or 256 per warp), and holds 16
    to 64 packed words a step times BLOCK_M (its accumulators: at most about CONFIGS' register use)."""
    tiles = []
    for block_n, warps in SWEEP_TILES:
        words_per_row = block_n // (32 * warps)  # columns per thread: one packed word per K row each
        for block_k in (16, 32, 64, 128):
            if 16 <= block_k // 8 * words_per_row * block_m <= 64:
                tiles += [(block_n, block_k, warps, stages) for stages in SWEEP_STAGES]
    return tiles


def arrival_counters(device: torch.device, grid_n: int) -> torch.Tensor | None:
    """The device's zeroed counters (the kernel leaves them zeroed), or None where the fused reduction is off, too
    few, or the counters would have to be made while a CUDA graph is captured."""
    if not FUSED_REDUCE or grid_n > MAX_COUNTERS:
        return None
    counters = _counters.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = _counters[device] = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
    return counters


def gemv_applies(x2: torch.Tensor, codebook=None) -> bool:
    """x2 [M, K]: a decode batch the GEMV takes (CUDA, 1..GEMV_MAX_M rows; a codebook only with CODEBOOK_GEMV)."""
    if codebook is not None and not CODEBOOK_GEMV:
        return False
    return x2.is_cuda and triton is not None and 0 < x2.shape[0] <= GEMV_MAX_M


def wna16_gemv(x2, qweight, scales, zeros, bias, bits: int, group_size: int, codebook=None, perm=None) -> torch.Tensor:
    """x2 [M, K] (1 <= M <= 8, last dim contiguous) @ the dequantized weight [K, N] + bias -> [M, N] in x2's dtype.
    zeros [groups, N] or None (the midpoint; a codebook has none); codebook [2**bits] float32 or None; perm [K] or
    None: the weight's row k multiplies x2[:, perm[k]] (act order)."""
    m, k = x2.shape
    n = qweight.shape[1]
    if not 0 < m <= 8:
        raise ValueError(f"wna16_gemv takes 1 to 8 rows, got {m}")
    cfg = gemv_config(m, n, k, bits, group_size, perm is not None, sm_count(x2.device))
    splits = cfg.splits
    grid_n = triton.cdiv(n, cfg.block_n)
    out = torch.empty((m, n), dtype=x2.dtype, device=x2.device)  # [M, N]
    counters = arrival_counters(x2.device, grid_n) if splits > 1 else None
    part = out if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32, device=x2.device)
    has_bias = bias is not None
    bias_arg = bias if has_bias else scales
    # the fused reduction's loads in flight: up to 8, within about 32 registers a thread
    unroll = max(1, min(8, 32 * 32 * cfg.warps // (cfg.block_m * cfg.block_n)))
    pairs = pairs_mode(x2) if PAIRS and pairs_apply(x2, bits, cfg.one_group, codebook, perm) else 0
    wna16_gemv_kernel[(grid_n, splits)](
        x2, qweight, scales, zeros if zeros is not None else scales, codebook if codebook is not None else scales,
        perm if perm is not None else qweight, bias_arg, part, out, counters if counters is not None else qweight,
        m, n, k, group_size, cfg.k_split, x2.stride(0), MAGIC, 16,
        BITS=bits, HAS_ZP=zeros is not None, HAS_BIAS=has_bias, ONE_GROUP=cfg.one_group,
        CODEBOOK=codebook is not None, PERM=perm is not None, SPLIT=splits > 1, FUSED=counters is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, STAGES=cfg.stages, UNROLL=unroll,
        PAIRS=pairs, num_warps=cfg.warps, **pdl(x2),
    )  # fmt: skip
    if splits > 1 and counters is None:
        block = 1024
        split_k_reduce_kernel[(triton.cdiv(m * n, block),)](
            part, out, bias_arg, m * n, n, splits, HAS_BIAS=has_bias, BLOCK=block
        )
    return out
