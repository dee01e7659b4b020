"""Triton GEMMs of weight-only integer quantization (W4A16 / W8A16), weights in the K-packed layout of
int_packing.py: qweight int32 [ceil(K / pack), N], scales [num_groups, N], zeros [num_groups, N] or none (symmetric:
the midpoint 2**(bits - 1)), group of input feature k = k // group_size.

Decode batches of at most wna16_gemv.GEMV_MAX_M rows on CUDA take the GEMV of wna16_gemv.py (CUDA cores). Small
batches (M <= GEMM_MAX_M): one kernel reads each packed word once from memory, unpacks its values in
registers (the word is loaded for each of its K rows: those loads hit the cache), dequantizes them
((q - zero) * scale, float32) to the activations' dtype and multiplies on the tensor cores with float32 accumulation.
When the N blocks alone would not fill the GPU, K is split and the float32 partials are summed in a fixed order by
fp8_gemv's reduce kernel (deterministic). Larger batches: a kernel dequantizes the weight once into a [K, N] buffer
in the activations' dtype, then the dense GEMM (cuBLAS) runs on it.

A codebook (bitsandbytes' nf4 / fp4: 16 float32 values, `codebook`) replaces the affine rule: w = codebook[q] * scale,
no zero points."""

from __future__ import annotations

import torch

from pagedllm.layers.quantization import wna16_gemv as wna16_gemv_module
from pagedllm.layers.quantization.fp8_gemv import sm_count, split_k_reduce_kernel
from pagedllm.layers.quantization.fp8_ops import triton
from pagedllm.layers.quantization.wna16_gemv import gemv_applies, wna16_gemv

GEMM_MAX_M = 64  # batches up to this many rows take the fused kernel; larger ones dequantize then GEMM
BLOCK_N = 64  # output columns per program
BLOCK_K = 128  # input features per step (a multiple of every pack factor)
PROGRAMS_PER_SM = 2  # programs wanted per SM before K is split
DEQUANT_BLOCK = (64, 64)  # [K, N] tile of the dequantization kernel

if triton is not None:
    import triton.language as tl

    @triton.jit
    def dequant_tile(
        qw_ptr, s_ptr, z_ptr, cb_ptr, offs_k, offs_n, mask_k, mask_n, N, group_size,
        BITS: tl.constexpr, HAS_ZP: tl.constexpr, ONE_GROUP: tl.constexpr, CODEBOOK: tl.constexpr,
    ):  # fmt: skip
        """The float32 weight tile [BLOCK_K, BLOCK_N] of input features offs_k and outputs offs_n (0 where masked).
        ONE_GROUP: every offs_k is in the group of offs_k[0] (one scale row loaded, not a [K, N] gather).
        CODEBOOK: w = cb[q] * s (cb_ptr: 2**BITS float32 values), else the affine (q - z) * s."""
        pack: tl.constexpr = 32 // BITS
        mask = mask_k[:, None] & mask_n[None, :]
        words = tl.load(qw_ptr + (offs_k // pack)[:, None] * N + offs_n[None, :], mask=mask, other=0)
        q_int = (words >> ((offs_k % pack) * BITS)[:, None]) & ((1 << BITS) - 1)
        if CODEBOOK:
            q = tl.load(cb_ptr + q_int)  # 16-entry table: these loads hit the cache
        else:
            q = q_int.to(tl.float32)
        if ONE_GROUP:
            g = tl.min(offs_k, axis=0) // group_size
            s = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            if HAS_ZP:
                z = tl.load(z_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            elif CODEBOOK:
                z = 0.0
            else:
                z = (1 << (BITS - 1)) * 1.0
        else:
            g = offs_k // group_size
            s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_ZP:
                z = tl.load(z_ptr + g[:, None] * N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
            elif CODEBOOK:
                z = 0.0
            else:
                z = (1 << (BITS - 1)) * 1.0
        return tl.where(mask, (q - z) * s, 0.0)

    # M only bounds masks: one compiled variant per BLOCK_M for every batch size (M = 1 and multiples of 16 would
    # each compile apart)
    @triton.jit(do_not_specialize=["M"])
    def wna16_gemm_kernel(
        x_ptr, qw_ptr, s_ptr, z_ptr, cb_ptr, bias_ptr, out_ptr, M, N, K, group_size, k_split,
        stride_xm, stride_os, stride_om,
        BITS: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, ONE_GROUP: tl.constexpr,
        CODEBOOK: tl.constexpr,
        IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """Program (n, s, m): out[s, m-block, n-block] = x[m-block, K split s] @ W[K split s, n-block] (+ bias with
        one split). x [M, K]; out [S, M, N] (x's dtype for S = 1, float32 partials otherwise)."""
        pid_n, pid_s, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m, mask_n = offs_m < M, offs_n < N
        k_lo = pid_s * k_split
        k_hi = tl.minimum(k_lo + k_split, K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(k_lo, k_hi, BLOCK_K):
            offs_k = start + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
            x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            w = dequant_tile(
                qw_ptr, s_ptr, z_ptr, cb_ptr, offs_k, offs_n, mask_k, mask_n, N, group_size,
                BITS, HAS_ZP, ONE_GROUP, CODEBOOK,
            ).to(x.dtype)  # fmt: skip  # [BLOCK_K, BLOCK_N]
            if IEEE:
                acc = tl.dot(x, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + pid_s * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])

    @triton.jit
    def wna16_dequant_kernel(
        qw_ptr, s_ptr, z_ptr, cb_ptr, w_ptr, N, K, group_size,
        BITS: tl.constexpr, HAS_ZP: tl.constexpr, CODEBOOK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """w [K, N] (its dtype) = the dequantized weight, one [BLOCK_K, BLOCK_N] tile per program."""
        offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_k, mask_n = offs_k < K, offs_n < N
        w = dequant_tile(
            qw_ptr, s_ptr, z_ptr, cb_ptr, offs_k, offs_n, mask_k, mask_n, N, group_size, BITS, HAS_ZP, False, CODEBOOK
        )
        ptrs = w_ptr + offs_k[:, None] * N + offs_n[None, :]
        tl.store(ptrs, w.to(w_ptr.dtype.element_ty), mask=mask_k[:, None] & mask_n[None, :])


def block_k_for(group_size: int) -> tuple[int, bool]:
    """(BLOCK_K, one group per K step): BLOCK_K divides the group size where one of 128, 64, 32, 16 does."""
    for block_k in (BLOCK_K, 64, 32, 16):
        if group_size % block_k == 0:
            return block_k, True
    return BLOCK_K, False


def plan_splits(n: int, k: int, m_blocks: int, block_k: int, sms: int) -> tuple[int, int]:
    """(number of K splits, K per split: a multiple of block_k) so that about PROGRAMS_PER_SM programs run per SM."""
    chunks = triton.cdiv(k, block_k)
    programs = triton.cdiv(n, BLOCK_N) * m_blocks
    want = max(1, min(chunks, triton.cdiv(PROGRAMS_PER_SM * sms, programs)))
    k_split = triton.cdiv(chunks, want) * block_k
    return triton.cdiv(k, k_split), k_split


def wna16_gemm(x2, qweight, scales, zeros, bias, bits: int, group_size: int, codebook=None) -> torch.Tensor:
    """x2 [M, K] (M <= GEMM_MAX_M, last dim contiguous) @ the dequantized weight [K, N] + bias -> [M, N], x's dtype.
    codebook: [2**bits] float32 values of the codes (zeros then None), or None: affine."""
    m, k = x2.shape
    n = qweight.shape[1]
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    m_blocks = triton.cdiv(m, block_m)
    block_k, one_group = block_k_for(group_size)
    splits, k_split = plan_splits(n, k, m_blocks, block_k, sm_count(x2.device))
    out = torch.empty((m, n), dtype=x2.dtype, device=x2.device)  # [M, N]
    target = out if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32, device=x2.device)
    has_bias, has_zp = bias is not None, zeros is not None
    bias_arg = bias if has_bias else scales
    wna16_gemm_kernel[(triton.cdiv(n, BLOCK_N), splits, m_blocks)](
        x2, qweight, scales, zeros if has_zp else scales, codebook if codebook is not None else scales, bias_arg,
        target, m, n, k, group_size, k_split, x2.stride(0), m * n, n,
        BITS=bits, HAS_ZP=has_zp, HAS_BIAS=has_bias and splits == 1, ONE_GROUP=one_group,
        CODEBOOK=codebook is not None,
        IEEE=x2.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=block_k,
        num_stages=2 if x2.dtype == torch.float32 else 3,  # float32 tiles at 3 stages pass Hopper's shared memory
    )  # fmt: skip
    if splits > 1:
        block = 1024
        split_k_reduce_kernel[(triton.cdiv(m * n, block),)](
            target, out, bias_arg, m * n, n, splits, HAS_BIAS=has_bias, BLOCK=block
        )
    return out


def wna16_dequantize(
    qweight, scales, zeros, k: int, bits: int, group_size: int, dtype: torch.dtype, codebook=None
) -> torch.Tensor:
    """The dequantized weight [K, N] in dtype."""
    n = qweight.shape[1]
    w = torch.empty((k, n), dtype=dtype, device=qweight.device)  # [K, N]
    bk, bn = DEQUANT_BLOCK
    wna16_dequant_kernel[(triton.cdiv(k, bk), triton.cdiv(n, bn))](
        qweight, scales, zeros if zeros is not None else scales, codebook if codebook is not None else scales, w, n, k,
        group_size, BITS=bits, HAS_ZP=zeros is not None, CODEBOOK=codebook is not None, BLOCK_K=bk, BLOCK_N=bn,
    )  # fmt: skip
    return w


def wna16_linear(x, qweight, scales, zeros, bias, perm, bits: int, group_size: int, codebook=None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype; perm [K]: the input-feature order the weight's rows were sorted into
    (act-order checkpoints), or None; codebook: see wna16_gemm."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)  # [M, K]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if perm is not None and not (wna16_gemv_module.PERM_IN_KERNEL and gemv_applies(x2, codebook)):
        x2, perm = x2[:, perm], None
    if gemv_applies(x2, codebook):  # with perm: applied inside, no gather launch
        return wna16_gemv(x2, qweight, scales, zeros, bias, bits, group_size, codebook, perm).reshape(
            *x.shape[:-1], qweight.shape[1]
        )
    if 0 < x2.shape[0] <= GEMM_MAX_M:
        out = wna16_gemm(x2, qweight, scales, zeros, bias, bits, group_size, codebook)
    else:
        out = x2 @ wna16_dequantize(qweight, scales, zeros, k, bits, group_size, x2.dtype, codebook)
        if bias is not None:
            out = out + bias
    return out.reshape(*x.shape[:-1], qweight.shape[1])
