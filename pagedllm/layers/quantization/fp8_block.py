"""Block-wise FP8 on CUDA: activations quantized per token and group of `bk` features, then a Triton GEMM that
scales each [BLOCK_M, BLOCK_N] partial product of one k-group by the activations' group scales and the weight's block
scale (weights fp8 [N, K] with one float32 scale per [bn, bk] block, as "fp8" checkpoints with weight_block_size and
compressed-tensors' FP8_BLOCK store them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.layers.quantization.fp8_ops import quantize_per_token, triton

if triton is not None:
    import triton.language as tl

    @triton.jit(do_not_specialize=["M"])  # M only bounds masks: one variant per BLOCK_M for every batch size
    def block_fp8_matmul_kernel(
        a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, M, N, K, group_n,
        stride_am, stride_bn, stride_cm, stride_as_m, stride_bs_n,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """c [M, N] = sum over k-groups g of (a[:, g] @ b[:, g].T) * as[:, g] * bs[n // group_n, g]; a [M, Kp] fp8
        (Kp: K padded to BLOCK_K), b [N, K] fp8, as [M, G] and bs [ceil(N / group_n), G] float32, BLOCK_K = the
        group size, so each k step has one scale per row and one per column."""
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m, mask_n = offs_m < M, offs_n < N
        a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
        b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None]  # [BLOCK_K, BLOCK_N] of b.T
        as_ptrs = as_ptr + offs_m * stride_as_m
        bs_ptrs = bs_ptr + (offs_n // group_n) * stride_bs_n
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for g in range(0, tl.cdiv(K, BLOCK_K)):
            mask_k = offs_k < K - g * BLOCK_K
            a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            a_s = tl.load(as_ptrs + g, mask=mask_m, other=0.0)
            b_s = tl.load(bs_ptrs + g, mask=mask_n, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def quantize_per_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, Kp] fp8, scale [M, Kp / group] float32): one scale per token and run of `group` features,
    K zero-padded to Kp, a multiple of group."""
    m, k = x.shape
    padded = F.pad(x, (0, -k % group)) if k % group else x
    q, scale = quantize_per_token(padded.reshape(-1, group))  # [M * G, group], [M * G, 1]
    return q.reshape(m, -1), scale.reshape(m, -1)


def block_fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x [..., K] @ (weight [N, K] fp8 scaled per [bn, bk] block by weight_scale [ceil(N/bn), ceil(K/bk)]).T + bias
    -> [..., N] in x's dtype, the activations quantized per token and group of bk features."""
    n, k = weight.shape
    bn, bk = block
    x2 = x.reshape(-1, k)  # [M, K]
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)  # [M, N]
    if m:
        q, scale = quantize_per_group(x2, bk)
        block_m = 16 if m <= 16 else 64
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, 64))
        block_fp8_matmul_kernel[grid](
            q, weight, out, scale, weight_scale, m, n, k, bn,
            q.stride(0), weight.stride(0), out.stride(0), scale.stride(0), weight_scale.stride(0),
            BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=bk,
        )  # fmt: skip
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], n)


def block_gemm_supported(device: torch.device, block: tuple[int, int]) -> bool:
    """The Triton GEMM runs on CUDA with k-groups that fp8 tl.dot takes (a power of two, at least 32)."""
    bk = block[1]
    return device.type == "cuda" and triton is not None and bk >= 32 and bk & (bk - 1) == 0
