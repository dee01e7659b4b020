"""Row-wise scaled FP8 GEMM in Triton for mid-sized batches: c [M, N] = (a [M, K] fp8 @ b [N, K].T fp8) * as [M]
* bs [N], float32 sums, written in c's dtype. cuBLASLt's row-wise scaled kernel (torch._scaled_mm) tiles a batch
of a few hundred rows 128 x 128 with no split of K, so a 4096-column linear at 256 rows runs on 64 of an H100's 132
SMs; here the tiles come per batch size (16-row steps) and shape from the tables (BLOCK_M 64 for up to 64 rows a
tile, more column tiles), and where they still leave SMs idle K is split over programs whose float32 partials are
summed in a fixed order by the last program of each output tile (an arrival counter, re-zeroed by that program): one
launch, reproducible.

Which batches take it is measured, not guessed: `benchmarks/fp8_gemm_bench.py` times both on Llama-3.1-8B's
shapes (MEASURED_SHAPES) and prints SHAPE_TABLE (per rows key and shape, the tiles that beat cuBLASLt) and TABLE
(per power-of-two bucket, a layer's four linears on one tile, for other shapes); a batch with no entry keeps
torch._scaled_mm."""

from __future__ import annotations

import torch

from pagedllm.kernels import SplitCounters, interpreting
from pagedllm.layers.quantization.fp8_gemv import sm_count
from pagedllm.layers.quantization.fp8_ops import triton

# (N, K) the bench measures, Llama-3.1-8B's qkv, o, gate_up, down: their batches take SHAPE_TABLE's entry or,
# without one, torch._scaled_mm (cuBLASLt); other shapes take TABLE's entry for the batch's power-of-two bucket.
MEASURED_SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
# (rows key, N, K) -> (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, programs wanted per SM before K stops being
# split); the rows key is the batch rounded up to a multiple of 16 up to 256 rows (the CUDA graphs' sizes step by 8
# and 16 there), a power of two above (rows_key). From `benchmarks/fp8_gemm_bench.py` on an H200 (32..256 rows by
# 16, 512, 1024): the tiles that beat cuBLASLt by 3%; the measured keys not here were cuBLASLt's.
SHAPE_TABLE: dict[tuple[int, int, int], tuple[int, int, int, int, int, int]] = {
    (32, 4096, 4096): (64, 64, 128, 4, 6, 1),
    (32, 4096, 14336): (64, 128, 128, 4, 4, 1),
    (48, 6144, 4096): (64, 64, 128, 4, 6, 1),
    (48, 4096, 4096): (64, 64, 128, 4, 6, 1),
    (48, 28672, 4096): (64, 128, 128, 4, 4, 1),
    (48, 4096, 14336): (64, 64, 128, 4, 4, 2),
    (64, 6144, 4096): (64, 32, 256, 4, 4, 1),
    (64, 4096, 4096): (64, 32, 256, 4, 4, 1),
    (64, 28672, 4096): (64, 128, 128, 4, 4, 1),
    (64, 4096, 14336): (64, 32, 256, 4, 4, 1),
    (96, 4096, 14336): (64, 128, 128, 4, 4, 1),
    (112, 4096, 4096): (64, 64, 128, 4, 6, 1),
    (112, 4096, 14336): (64, 128, 128, 4, 4, 1),
    (128, 6144, 4096): (64, 64, 128, 4, 6, 1),
    (128, 4096, 4096): (64, 32, 256, 4, 4, 1),
    (128, 4096, 14336): (64, 64, 128, 4, 6, 1),
    (144, 4096, 14336): (64, 128, 128, 4, 4, 1),
    (160, 28672, 4096): (64, 128, 128, 4, 4, 4),
    (160, 4096, 14336): (64, 128, 128, 4, 4, 1),
    (176, 6144, 4096): (64, 128, 128, 4, 4, 1),
    (176, 28672, 4096): (64, 128, 128, 4, 4, 4),
    (176, 4096, 14336): (64, 128, 128, 4, 4, 1),
    (192, 6144, 4096): (64, 64, 128, 4, 4, 1),
    (192, 4096, 4096): (64, 64, 128, 4, 6, 1),
    (192, 28672, 4096): (64, 128, 128, 4, 4, 2),
    (192, 4096, 14336): (64, 64, 128, 4, 4, 2),
    (240, 4096, 14336): (64, 128, 128, 8, 4, 1),
    (256, 4096, 4096): (64, 64, 128, 4, 6, 1),
    (256, 4096, 14336): (64, 64, 128, 4, 6, 1),
    (512, 6144, 4096): (128, 128, 128, 4, 3, 1),
}
# power-of-two bucket (at least 16) -> the same, for any other shape. From the bench on an H100 80GB HBM3 (a
# layer's four linears on one tile: 33-64 rows 0.88 of cuBLASLt's time, 17-32 rows 0.97; 65+ rows slower).
TABLE: dict[int, tuple[int, int, int, int, int, int]] = {32: (64, 128, 128, 4, 4, 1), 64: (64, 64, 128, 4, 4, 1)}
SWEEP = (
    (64, 32, 128, 4, 6),
    (64, 32, 256, 4, 4),
    (64, 64, 128, 4, 4),
    (64, 64, 128, 4, 6),
    (64, 64, 256, 4, 3),
    (64, 128, 128, 4, 4),
    (64, 128, 128, 8, 4),
    (64, 256, 128, 8, 3),
    (128, 32, 128, 4, 5),
    (128, 64, 128, 4, 4),
    (128, 64, 128, 8, 4),
    (128, 128, 128, 4, 3),
    (128, 128, 128, 8, 4),
    (128, 256, 128, 8, 3),
    (256, 64, 128, 8, 3),
    (256, 128, 128, 8, 3),
)  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) the bench tries, each with 1, 2 and 4 programs per SM
MIN_SPLIT_STEPS = 4  # BLOCK_K steps a K split runs at least
_split = SplitCounters()  # the arrival counters of split launches, per device

if triton is not None:
    import triton.language as tl

    @triton.jit(do_not_specialize=["M"])
    def fp8_rowwise_mm_kernel(
        a_ptr, b_ptr, as_ptr, bs_ptr, part_ptr, c_ptr, cnt_ptr, M, N, K, k_split, stride_am, stride_bn, stride_cm,
        SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        STAGES: tl.constexpr, EMULATE: tl.constexpr,
    ):  # fmt: skip
        """Program (m, n, s): rows of tile m, columns of tile n, K split s (K and k_split multiples of BLOCK_K).
        Rows past M and columns past N read row M - 1 / column N - 1 (no masks in the loop) and are not stored.
        EMULATE (Triton's interpreter): the fp8 tiles widen to bfloat16 first (exact) for the dot."""
        pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.minimum(offs_m, M - 1).to(tl.int64)
        cols = tl.minimum(offs_n, N - 1).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        k_lo = pid_s * k_split
        a_ptrs = a_ptr + rows[:, None] * stride_am + (k_lo + offs_k)[None, :]
        b_ptrs = b_ptr + cols[None, :] * stride_bn + (k_lo + offs_k)[:, None]  # [BLOCK_K, BLOCK_N] of b.T
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in tl.range(0, tl.minimum(k_split, K - k_lo) // BLOCK_K, num_stages=STAGES):
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
            if EMULATE:
                acc += tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
            else:
                acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        out_off = offs_m[:, None] * stride_cm + offs_n[None, :]
        if SPLIT:
            tile = offs_m[:, None] * N + offs_n[None, :]  # partials [S, M, N]
            tl.store(part_ptr + pid_s * M * N + tile, acc, mask=mask)
            tl.debug_barrier()  # every thread's partials stored before the counter releases them
            splits = tl.num_programs(2)
            cnt = cnt_ptr + pid_m * tl.num_programs(1) + pid_n
            if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") != splits - 1:
                return
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(0, splits):  # fixed order: the same sum whichever program came last
                acc += tl.load(part_ptr + s * M * N + tile, mask=mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(cnt, 0)  # ready for the next launch
        a_s = tl.load(as_ptr + rows)
        b_s = tl.load(bs_ptr + cols)
        acc = acc * a_s[:, None] * b_s[None, :]
        tl.store(c_ptr + out_off, acc.to(c_ptr.dtype.element_ty), mask=mask)


def bucket(m: int) -> int:
    """TABLE's key: m rounded up to a power of two, at least 16."""
    return max(16, 1 << (m - 1).bit_length())


def rows_key(m: int) -> int:
    """SHAPE_TABLE's key: m rounded up to a multiple of 16 up to 256 rows, bucket(m) above."""
    return -(-m // 16) * 16 if m <= 256 else bucket(m)


def table_config(m: int, n: int, k: int) -> tuple[int, int, int, int, int, int] | None:
    """The Triton GEMM's config for x [m, k] @ W [n, k].T, None where torch._scaled_mm runs: for MEASURED_SHAPES
    SHAPE_TABLE's entry for the rows key, else TABLE's for the batch's bucket."""
    if (n, k) in MEASURED_SHAPES:
        return SHAPE_TABLE.get((rows_key(m), n, k))
    return TABLE.get(bucket(m))


def gemm_applies(x2: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the Triton GEMM takes the batch x2 [M, K]: CUDA, a table entry for its shape (table_config), K a
    multiple of the entry's BLOCK_K, a contiguous [N, K] weight."""
    if not x2.is_cuda or triton is None or x2.shape[0] == 0:
        return False
    entry = table_config(x2.shape[0], weight.shape[0], x2.shape[1])
    return entry is not None and x2.shape[1] % entry[2] == 0 and weight.stride(1) == 1


def plan(m: int, n: int, k: int, block_m: int, block_n: int, block_k: int, per_sm: int, sms: int) -> tuple[int, int]:
    """(K splits, K per split: whole BLOCK_K steps) for about per_sm programs per SM, MIN_SPLIT_STEPS or more a
    split."""
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    steps = k // block_k
    want = max(1, min(triton.cdiv(per_sm * sms, tiles), steps // MIN_SPLIT_STEPS))
    k_split = triton.cdiv(steps, want) * block_k
    return triton.cdiv(k, k_split), k_split


def fp8_rowwise_mm(xq, xs, weight, weight_scale, out_dtype, config=None) -> torch.Tensor:
    """xq [M, K] fp8, xs [M, 1] or [M] float32, weight [N, K] fp8, weight_scale [N] float32 -> [M, N] out_dtype.
    config: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, programs per SM), the table's entry (table_config) if None."""
    m, k = xq.shape
    n = weight.shape[0]
    block_m, block_n, block_k, warps, stages, per_sm = config or table_config(m, n, k)
    if k % block_k:
        raise ValueError(f"fp8_rowwise_mm: K={k} is not a multiple of BLOCK_K={block_k}")
    splits, k_split = plan(m, n, k, block_m, block_n, block_k, per_sm, sm_count(xq.device))
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), splits)
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    counters = part = out
    if splits > 1:
        counters = _split.take(xq.device, grid[0] * grid[1])
        if counters is None:  # no split then (a CUDA graph is being captured and the counters would have to grow)
            splits, k_split, counters = 1, k, out
            grid = grid[:2] + (1,)
        else:
            part = torch.empty((splits, m, n), dtype=torch.float32, device=xq.device)
    fp8_rowwise_mm_kernel[grid](
        xq, weight, xs.reshape(-1), weight_scale.reshape(-1), part, out, counters, m, n, k, k_split,
        xq.stride(0), weight.stride(0), out.stride(0),
        SPLIT=splits > 1, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages,
        EMULATE=interpreting() or not xq.is_cuda, num_warps=warps,
    )  # fmt: skip
    return out
