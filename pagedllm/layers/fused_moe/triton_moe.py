"""The experts on the GPU as two Triton grouped GEMMs over token-expert pairs sorted by expert.

The pairs are grouped by expert and each expert's group is padded to a multiple of BLOCK_M (`align_by_expert`), so
every BLOCK_M rows of the sorted list belong to one expert. GEMM 1 reads token rows of x and the expert's gate and
up rows of w13, and writes silu(gate) * up per pair [n * k, I]; GEMM 2 multiplies those by the expert's w2 and the
pair's routing weight [n * k, H]; the k pairs of each token are then summed. Everything stays on the device (no
host sync), so a decode step can be captured in a CUDA graph."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# num_pairs (tokens x top_k) only marks padding: one compiled variant for every batch size
@triton.jit(do_not_specialize=["num_pairs"])
def moe_gemm_kernel(
    a_ptr,  # [rows, K]: tokens (GEMM 1, A_ROW_DIV = top_k) or pairs (GEMM 2, A_ROW_DIV = 1)
    b_ptr,  # [E, N (x2 when GATED: gate rows then up rows), K]
    c_ptr,  # [num_pairs, N]
    weights_ptr,  # [num_pairs] float32 routing weights (MUL_WEIGHT)
    sorted_ids_ptr,  # [max_padded] int32 pair ids grouped by expert; num_pairs marks padding
    block_expert_ptr,  # [max_padded / BLOCK_M] int32 expert of each BLOCK_M rows
    num_padded_ptr,  # [1] rows of sorted_ids in use
    num_pairs,
    N,
    K,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    A_ROW_DIV: tl.constexpr,
    GATED: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.num_programs(0) // tl.cdiv(N, BLOCK_N)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_pid_n)  # GROUP_M row blocks share the B tiles they read while both are in L2
    first_m = group * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % size_m
    pid_n = (pid % (GROUP_M * num_pid_n)) // size_m
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + offs_m)
    row_ok = pairs < num_pairs
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pairs // A_ROW_DIV).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        if GATED:
            b_up = tl.load(b_ptrs + N * stride_bn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc_up = tl.dot(a, b_up, acc_up)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if GATED:  # silu(gate) * up, in float32
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids [max_padded] int32, block_expert [max_padded / block_m] int32, num_padded [1]): the pair ids
    (token * k + slot) grouped by expert, each group padded with `num_pairs` to a multiple of block_m, and the
    expert of each block_m rows. max_padded is an upper bound known from the shapes alone, so nothing waits for
    the device."""
    flat = topk_ids.reshape(-1).long()  # [num_pairs]
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E] (bincount would sync to size its output)
    padded_end = ((counts + block_m - 1) // block_m * block_m).cumsum(0)  # [E]
    padded_start = padded_end - (counts + block_m - 1) // block_m * block_m
    start = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)  # [num_pairs] pair ids by expert
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - start[sorted_experts]
    max_padded = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m
    sorted_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_ids[padded_start[sorted_experts] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, max_padded, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, block_expert.to(torch.int32), padded_end[-1:]


def moe_config(num_pairs: int, num_experts: int) -> dict:
    """Tile sizes by the average rows per expert (measured on an H100 over Mixtral and 64-expert shapes, bf16):
    thin tiles with a long K step for decode (many programs over N, so the few experts' weights stream from every
    SM), wider ones as the rows per expert grow."""
    rows = num_pairs / num_experts
    if rows <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
    if rows <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4)
    if rows <= 192:
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)


def _gemm(a, b, c, weights, aligned, num_pairs, n, k, row_div, gated, config):
    sorted_ids, block_expert, num_padded = aligned
    grid = (block_expert.numel() * triton.cdiv(n, config["BLOCK_N"]),)
    moe_gemm_kernel[grid](
        a, b, c, weights, sorted_ids, block_expert, num_padded, num_pairs, n, k,
        a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        A_ROW_DIV=row_div, GATED=gated, MUL_WEIGHT=not gated, **config,
    )  # fmt: skip


def fused_experts_triton(
    x: torch.Tensor,  # [n, H]
    w13: torch.Tensor,  # [E, 2 * I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [n, k] float32
    topk_ids: torch.Tensor,  # [n, k]
    config: dict | None = None,
) -> torch.Tensor:
    """The SiLU-gated experts of each token, weighted and summed: [n, H] in x.dtype."""
    n, k = topk_ids.shape
    num_experts, inter, hidden = w13.shape[0], w2.shape[2], x.shape[1]
    num_pairs = n * k
    if n == 0:
        return torch.zeros_like(x)
    config = config or moe_config(num_pairs, num_experts)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    weights = topk_weights.reshape(-1).float().contiguous()  # [num_pairs]
    aligned = align_by_expert(topk_ids, num_experts, config["BLOCK_M"])
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)  # [n * k, I]
    _gemm(x, w13, act, weights, aligned, num_pairs, inter, hidden, k, True, config)
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)  # [n * k, H]
    _gemm(act, w2, out, weights, aligned, num_pairs, hidden, inter, 1, False, config)
    return out.view(n, k, hidden).sum(dim=1) if k > 1 else out.view(n, hidden)
