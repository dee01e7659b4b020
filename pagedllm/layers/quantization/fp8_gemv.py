"""FP8 (W8A8) skinny GEMM for small batches (decode): out [M, N] = (qx [M, K] fp8 @ qw [N, K].T fp8) * sx [M] * sw [N]
+ bias, for M <= GEMV_MAX_M, where cuBLASLt's scaled GEMM leaves most of the memory bandwidth unused. The same kernel
multiplies bfloat16/float16 weights with activations of their dtype (DENSE, no scales: `dense_gemv`), which the dense
linear layers take on the GPU for one row (decode at batch 1): its launch overlaps the kernel before it (PDL), which
cuBLAS's cannot.

The weight read dominates (N * K bytes against M * K of activations, whose rows past M are masked off, so not
read): each program owns BLOCK_N weight rows and a slice of K, streams its [BLOCK_N, BLOCK_K] fp8 tiles and multiplies
them with the activations' [BLOCK_K, 16] tile on the tensor cores ("swap AB": the weight is the MMA's tall operand),
summing in float32. When N / 16 programs would not fill the GPU, K is split and a second small kernel sums the
float32 partials (in a fixed order: deterministic), adds the bias and casts; with SPLIT_IN_KERNEL each n-block's
last program to finish does that sum instead (same order, same bits, one launch fewer), counting finished programs
in a per-device int32 buffer that every launch leaves zeroed (so launches on one device must not overlap: one
stream).

The activations come in their float dtype and are quantized inside the kernel (no separate launch): every program
first reads its rows' whole K (a few KB, in L2) for their amax, then rounds each [BLOCK_K, 16] tile to fp8 in
registers with the per-token kernel's own helpers (fused_ops.fp8_scale_of, fp8_quantize), so the fp8 activations, and
the result, are bit-identical to quantizing first. Batches over FUSE_MAX_M rows, and fp8_gemv, take pre-quantized
activations."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from pagedllm.kernels import SplitCounters, pdl
from pagedllm.layers.quantization.fp8_ops import quantize_activations, triton

GEMV_MAX_M = 16  # one 16-row MMA tile holds every row; the weight is read once whatever M is up to this
FUSE_MAX_M = 1  # batches of up to this many rows quantize their activations in the GEMV itself (H100: the
# fused kernel reads a layer's linears at M = 1 in 101 us against 113 us unfused, but 2..8 rows took 245-348 us)
BLOCK_NS = (64,)  # weight rows per program (an H200 sweep: 64 rows with K split beat narrower tiles)
BLOCK_K = 128  # fp8 weight columns per pipeline stage (>= 128: the MMA's promotion interval)
# the fused kernel's amax pass: columns per step (one row: up to AMAX_ROW, the whole row of Llama-3.1-8B's K but
# the down projection's; 16 rows: AMAX_COLS), steps in flight
AMAX_ROW, AMAX_COLS, AMAX_STAGES = 8192, 256, 3
PROGRAMS_PER_SM = 1  # programs per SM wanted before settling for one wave, or splitting K
NUM_WARPS, NUM_STAGES = 4, 4  # 4 stages of weight tiles in flight per program
# how the kernel gets its activations: fp8 with their scales | float, one static scale | float, a scale per row
# (amax / 448) | float, one scale per batch (the batch's amax / 448)
QUANTIZED, STATIC, PER_TOKEN, DENSE = 0, 1, 2, 3
DENSE_MAX_M = 1  # rows up to which the dense linear layers take the kernel (dense_gemv_applies)

if triton is not None:
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    from pagedllm.kernels.fused_ops import fp8_quantize, fp8_scale_of, wait_previous_kernel

    @triton.jit
    def activation_scales(
        x_ptr, xs_ptr, M, K, stride_xm, QUANT: tl.constexpr, ONE_ROW: tl.constexpr, BLOCK_M: tl.constexpr,
        AMAX_K: tl.constexpr, AMAX_STAGES: tl.constexpr,
    ):  # fmt: skip
        """The activations' scales [BLOCK_M] float32: loaded (QUANTIZED, STATIC) or from the amax of x's rows over
        all of K (PER_TOKEN), AMAX_K columns a step, AMAX_STAGES steps in
        flight. ONE_ROW: M is 1, the scale in every lane."""
        offs_m = tl.arange(0, BLOCK_M)
        if QUANT == 3:
            xs = tl.full((BLOCK_M,), 1.0, dtype=tl.float32)  # unused
        elif QUANT == 0:
            xs = tl.load(xs_ptr + offs_m, mask=offs_m < M, other=0.0)
        elif QUANT == 1:
            xs = tl.zeros((BLOCK_M,), dtype=tl.float32) + tl.load(xs_ptr).to(tl.float32)
        elif ONE_ROW:
            offs_k = tl.arange(0, AMAX_K)
            amax = tl.zeros((AMAX_K,), dtype=tl.float32)
            for start in tl.range(0, K, AMAX_K, num_stages=AMAX_STAGES):
                x = tl.load(x_ptr + start + offs_k, mask=offs_k < K - start, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            xs = tl.zeros((BLOCK_M,), dtype=tl.float32) + fp8_scale_of(tl.max(amax, axis=0))
        else:
            offs_k = tl.arange(0, AMAX_K)
            ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, AMAX_K]
            amax = tl.zeros((BLOCK_M, AMAX_K), dtype=tl.float32)
            for start in tl.range(0, K, AMAX_K, num_stages=AMAX_STAGES):
                mask = (offs_m[:, None] < M) & (offs_k[None, :] < K - start)
                amax = tl.maximum(amax, tl.abs(tl.load(ptrs + start, mask=mask, other=0.0).to(tl.float32)))
            xs = fp8_scale_of(tl.max(amax, axis=1))  # [BLOCK_M]
        return xs

    # M (the decode batch) only bounds masks: one compiled variant for every batch size instead of three (M = 1,
    # M = 16, others); ONE_ROW (M == 1 with quantization in the kernel) is the one split, M = 1 being decode-bs1.
    # S (K splits) neither: SPLIT tells one split from several
    @triton.jit(do_not_specialize=["M", "S"])
    def fp8_gemv_kernel(
        x_ptr, w_ptr, out_ptr, part_ptr, cnt_ptr, xs_ptr, ws_ptr, bias_ptr, M, N, K, S, k_split,
        stride_xm, stride_wn, stride_om,
        HAS_BIAS: tl.constexpr, QUANT: tl.constexpr, ONE_ROW: tl.constexpr, SPLIT: tl.constexpr, W_TMA: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, AMAX_K: tl.constexpr,
        AMAX_STAGES: tl.constexpr, USE_PDL: tl.constexpr,
    ):  # fmt: skip
        """Program (n, s) of S: the n-block's sum over k in [s * k_split, (s + 1) * k_split) of x[m, k] * w[n, k],
        times xs[m] * ws[n], stored by store_result (SPLIT). x [M, K]: fp8 with scales xs [M] (QUANTIZED) or float,
        quantized here (STATIC: xs [1] the scale; PER_TOKEN: xs unused); w [N, K] fp8 (W_TMA: its
        tensor descriptor of [BLOCK_N, BLOCK_K] blocks, read by the TMA unit), ws [N] float32;
        out [M, N]; part [S, M, N] float32 and cnt [cdiv(N, BLOCK_N)] int32 (zeros) for split K. USE_PDL: see
        kernels/__init__.py (pdl)."""
        wait_previous_kernel(USE_PDL)
        pid_n, pid_s = tl.program_id(0), tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m, mask_n = offs_m < M, offs_n < N
        x_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]  # [BLOCK_K, BLOCK_M] of x.T
        if not W_TMA:
            w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
        xs = activation_scales(x_ptr, xs_ptr, M, K, stride_xm, QUANT, ONE_ROW, BLOCK_M, AMAX_K, AMAX_STAGES)
        scale0 = tl.max(xs, axis=0)  # xs [BLOCK_M]; ONE_ROW: the row's scale
        k_lo = pid_s * k_split
        k_hi = tl.minimum(k_lo + k_split, K)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        # ONE_ROW: the row's next chunk loaded an iteration ahead (a [BLOCK_K] load is too narrow per thread for
        # the compiler's async pipelining, and would otherwise wait out an L2 round trip every iteration)
        if ONE_ROW:
            x_next = tl.load(x_ptr + k_lo + offs_k, mask=offs_k < K - k_lo, other=0.0)
        for start in range(k_lo, k_hi, BLOCK_K):
            mask_k = offs_k < K - start
            if QUANT == 0 or QUANT == 3:
                x = tl.load(x_ptrs + start, mask=mask_k[:, None] & mask_m[None, :], other=0.0)
            elif ONE_ROW:  # one row quantized, copied to every column (columns past M are never stored)
                x_row = x_next.to(tl.float32)  # [BLOCK_K]
                x_next = tl.load(x_ptr + start + BLOCK_K + offs_k, mask=offs_k < K - start - BLOCK_K, other=0.0)
                x = tl.broadcast_to(fp8_quantize(x_row, scale0)[:, None], (BLOCK_K, BLOCK_M))
            else:
                x = tl.load(x_ptrs + start, mask=mask_k[:, None] & mask_m[None, :], other=0.0).to(tl.float32)
                x = fp8_quantize(x, xs[None, :])  # [BLOCK_K, BLOCK_M]
            if W_TMA:  # past N and K: zeros
                w = w_ptr.load([pid_n * BLOCK_N, start])
            else:
                w = tl.load(w_ptrs + start, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            if QUANT == 3:
                acc = tl.dot(w, x, acc)  # [BLOCK_N, BLOCK_M]
            else:  # Hopper's fp8 MMA accumulates with a short mantissa: fold into the float32 sum every 128 products
                acc = tl.dot(w, x, acc, max_num_imprecise_acc=128)  # [BLOCK_N, BLOCK_M]
        if QUANT != 3:
            ws = tl.load(ws_ptr + offs_n, mask=mask_n, other=0.0)
            acc = acc * xs[None, :] * ws[:, None]
        offs = offs_m[None, :] * stride_om + offs_n[:, None]  # [BLOCK_N, BLOCK_M] into [M, N]
        mask = mask_n[:, None] & mask_m[None, :]
        if SPLIT == 0:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
            tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(part_ptr + pid_s * M * N + offs, acc, mask=mask)
            if SPLIT == 2:
                bias_ptrs = bias_ptr + offs_n
                split_k_last_program(
                    out_ptr, part_ptr, cnt_ptr, bias_ptrs, mask_n, pid_n, M * N, S, offs, mask, HAS_BIAS
                )

    @triton.jit
    def split_k_last_program(out_ptr, part_ptr, cnt_ptr, bias_ptrs, mask_n, pid_n, MN, S, offs, mask, HAS_BIAS):
        """The n-block's last program to store its partial sums part [S, M, N] in order s = 0, 1, ... (as
        split_k_reduce_kernel does: the same bits) + bias into out, and zeroes the n-block's counter for the next
        launch: split K without a second launch, still deterministic."""
        tl.debug_barrier()  # every thread's partials stored before the program counts itself done
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")  # release ours, acquire the others'
        if done == S - 1:
            total = tl.zeros(offs.shape, dtype=tl.float32)
            for s in range(0, S):
                total += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias_ptrs, mask=mask_n, other=0.0).to(tl.float32)[:, None]
            tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)

    @triton.jit
    def split_k_reduce_kernel(
        part_ptr, out_ptr, bias_ptr, MN, N, S, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
    ):  # fmt: skip
        """out [M, N] = sum over s of part [S, M, N] (float32, in order s = 0, 1, ...) + bias [N], in out's dtype."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < MN
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(0, S):
            acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: an H100's count, so CPU tests take the same split decisions
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan(n: int, k: int, sms: int) -> tuple[int, int, int]:
    """(BLOCK_N, number of K splits, K per split: a multiple of BLOCK_K) for an [N, K] weight on `sms` SMs: the
    widest tile with PROGRAMS_PER_SM programs per SM, else the narrowest if that fills every SM once, else the
    narrowest with K split (in whole chunks, no empty split) up to PROGRAMS_PER_SM programs per SM."""
    chunks = triton.cdiv(k, BLOCK_K)
    for block_n in BLOCK_NS:
        if triton.cdiv(n, block_n) >= PROGRAMS_PER_SM * sms:
            return block_n, 1, chunks * BLOCK_K
    block_n = BLOCK_NS[-1]
    grid_n = triton.cdiv(n, block_n)
    want = 1 if grid_n >= sms else max(1, min(chunks, triton.cdiv(PROGRAMS_PER_SM * sms, grid_n)))
    k_split = triton.cdiv(chunks, want) * BLOCK_K
    return block_n, triton.cdiv(k, k_split), k_split


W_TMA = False  # weight tiles read through a TMA tensor descriptor (K a multiple of 16, BLOCK_K <= 256)
SPLIT_ONE, SPLIT_REDUCE_KERNEL, SPLIT_LAST_PROGRAM = 0, 1, 2  # fp8_gemv_kernel's SPLIT: how split K is summed
SPLIT_IN_KERNEL = False  # split K summed by each n-block's last program (no second launch), not a reduce kernel
# (1 for one row, 16 for 2..16 rows; N, K) -> (BLOCK_N, BLOCK_K, warps, stages, K splits, split K summed in the
# kernel 0/1, TMA weight reads 0/1): per-shape tiles from `benchmarks/fp8_gemv_bench.py --sweep` (it prints this
# literal); shapes not here take the module settings above through plan()
# measured on an H100 80GB HBM3 (benchmarks/fp8_gemv_bench.py --sweep): Llama-3.1-8B's layer shapes
TABLE: dict[tuple[int, int, int], tuple[int, int, int, int, int, int, int]] = {
    (1, 6144, 4096): (64, 128, 4, 6, 1, 0, 1),
    (1, 4096, 4096): (64, 128, 4, 3, 5, 1, 0),
    (1, 28672, 4096): (64, 128, 4, 3, 1, 0, 1),
    (1, 4096, 14336): (64, 128, 4, 4, 5, 1, 1),
}


class Fp8GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    warps: int
    stages: int
    splits: int
    k_split: int  # K per split: whole BLOCK_K chunks
    split_in_kernel: bool
    w_tma: bool


def gemv_config(m: int, n: int, k: int, sms: int, fp8: bool = True) -> Fp8GemvConfig:
    """The tiles for x [m, k] @ W [n, k].T: TABLE's entry for the fp8 shape (splits capped by K's chunks), else
    plan() with the module settings."""
    entry = TABLE.get((1 if m == 1 else 16, n, k)) if fp8 else None
    if entry is None:
        block_n, splits, k_split = plan(n, k, sms)
        in_kernel = SPLIT_IN_KERNEL or not fp8  # (DENSE: its split K summed without a second, non-PDL launch)
        return Fp8GemvConfig(block_n, BLOCK_K, NUM_WARPS, NUM_STAGES, splits, k_split, in_kernel, W_TMA)
    block_n, block_k, warps, stages, want, in_kernel, w_tma = entry
    k_split = triton.cdiv(triton.cdiv(k, block_k), max(1, want)) * block_k
    return Fp8GemvConfig(
        block_n, block_k, warps, stages, triton.cdiv(k, k_split), k_split, bool(in_kernel), bool(w_tma)
    )


_split = SplitCounters()
_counters, _outgrown = _split.buffers, _split.outgrown
split_counters = _split.take  # (device, at least n) -> zeroed counters, or None while capturing a graph


def launch(
    x: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias, dtype, quant: int
) -> torch.Tensor:
    """fp8_gemv_kernel over x [M, K] (fp8 or float per `quant`; last dim contiguous), xs (per `quant`), weight
    [N, K] fp8, weight_scale [N] float32, bias [N] or None -> [M, N] in dtype; split-K partials summed by the
    kernel's last programs (SPLIT_IN_KERNEL) or by split_k_reduce_kernel after it."""
    m, k = x.shape
    n = weight.shape[0]
    cfg = gemv_config(m, n, k, sm_count(x.device), quant != DENSE)
    block_n, splits, block_k = cfg.block_n, cfg.splits, cfg.block_k
    grid_n = triton.cdiv(n, block_n)
    out = torch.empty((m, n), dtype=dtype, device=x.device)  # [M, N]
    part = out if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    counters = split_counters(x.device, grid_n) if splits > 1 and cfg.split_in_kernel else None
    split = SPLIT_ONE if splits == 1 else SPLIT_LAST_PROGRAM if counters is not None else SPLIT_REDUCE_KERNEL
    has_bias = bias is not None
    bias_arg = bias if has_bias else weight_scale
    one_row = m == 1 and quant not in (QUANTIZED, DENSE)
    w_tma = cfg.w_tma and k % 16 == 0 and weight.data_ptr() % 16 == 0 and block_k <= 256 and block_n <= 256
    w_arg = TensorDescriptor.from_tensor(weight, [block_n, block_k]) if w_tma else weight
    amax_k = min(triton.next_power_of_2(max(k, 16)), AMAX_ROW if one_row else AMAX_COLS)
    fp8_gemv_kernel[(grid_n, splits)](
        x, w_arg, out, part, counters if counters is not None else weight_scale, xs, weight_scale, bias_arg,
        m, n, k, splits, cfg.k_split, x.stride(0), weight.stride(0), n,
        HAS_BIAS=has_bias, QUANT=quant, ONE_ROW=one_row, SPLIT=split, W_TMA=w_tma, BLOCK_M=16, BLOCK_N=block_n,
        BLOCK_K=block_k, AMAX_K=amax_k, AMAX_STAGES=AMAX_STAGES, num_warps=cfg.warps, num_stages=cfg.stages,
        **pdl(x),
    )  # fmt: skip
    if split == SPLIT_REDUCE_KERNEL:
        block = 1024
        split_k_reduce_kernel[(triton.cdiv(m * n, block),)](
            part, out, bias_arg, m * n, n, splits, HAS_BIAS=has_bias, BLOCK=block
        )
    return out


def fp8_gemv(
    xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias, dtype: torch.dtype
) -> torch.Tensor:
    """xq [M, K] fp8 (1 <= M <= GEMV_MAX_M), xs [M, 1] float32, weight [N, K] fp8, weight_scale [N] float32,
    bias [N] or None -> [M, N] in dtype."""
    return launch(xq, xs, weight, weight_scale, bias, dtype, QUANTIZED)


def fp8_gemv_fused(
    x2: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x2 [M, K] float (1 <= M <= GEMV_MAX_M) -> [M, N] in x2's dtype, quantized inside the kernel by the rule of
    fp8_ops.quantize_activations: the static input_scale (a scalar), else per token."""
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    weight_scale = weight_scale.float()
    if input_scale is not None:
        return launch(x2, input_scale.float().reshape(1), weight, weight_scale, bias, x2.dtype, STATIC)
    return launch(x2, weight_scale, weight, weight_scale, bias, x2.dtype, PER_TOKEN)  # xs unused: a dummy


def dense_gemv(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x2 [M, K] (1 <= M <= GEMV_MAX_M) @ weight [N, K].T (+ bias) -> [M, N], all in x2's dtype (bfloat16 or
    float16; summed in float32)."""
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return launch(x2, weight, weight, weight, bias, x2.dtype, DENSE)  # (DENSE reads no scales: placeholders)


def dense_gemv_applies(x2: torch.Tensor, weight: torch.Tensor) -> bool:
    """dense_gemv takes what gemv_applies takes, up to DENSE_MAX_M rows, in bfloat16/float16 with a weight of the
    same dtype (float32 stays on cuBLAS: tl.dot would round it to TF32)."""
    return (
        gemv_applies(x2, weight) and x2.shape[0] <= DENSE_MAX_M
        and x2.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x2.dtype
    )  # fmt: skip


def gemv_applies(x2: torch.Tensor, weight: torch.Tensor) -> bool:
    """The skinny kernel takes CUDA batches of 1..GEMV_MAX_M rows with a contiguous [N, K] fp8 weight."""
    return (
        x2.is_cuda and triton is not None and 0 < x2.shape[0] <= GEMV_MAX_M and weight.stride(1) == 1
    )  # fmt: skip


def fp8_gemv_linear(
    x2: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    per_tensor_dynamic: bool = False,
) -> torch.Tensor:
    """x2 [M, K] -> [M, N] in x2's dtype: the activations quantized as fp8_linear does (in the kernel for up to
    FUSE_MAX_M rows, else by the per-token kernel first), then the skinny kernel."""
    if x2.shape[0] <= FUSE_MAX_M and not per_tensor_dynamic:  # (a batch's scale: computed by torch first)
        return fp8_gemv_fused(x2, weight, weight_scale, input_scale, bias)
    xq, xs = quantize_activations(x2, input_scale, per_tensor_dynamic)  # [M, K] fp8, [M, 1]
    return fp8_gemv(xq, xs, weight, weight_scale.float(), bias, x2.dtype)
