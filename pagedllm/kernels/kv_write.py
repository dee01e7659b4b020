"""The KV-cache write of the paged attention kernels: `write_kv_kernel`, or `rotary_write_kv_kernel`, which first
applies the rotary (and Qwen3's per-head q/k norm) to q and k: one launch instead of two.

Cache layout: [2, num_blocks, block_size, num_kv_heads, head_dim], K then V, rows contiguous. An FP8 cache (FP8_MAX >
0) stores k / k_scale and v / v_scale, saturated, and keeps V transposed within each block: the bytes of V's block
are [num_kv_heads, head_dim, block_size] (the tensor's shape stays; `triton_backend.cache_to_slot_major` reads it
back), so that the pairs of keys the attention's V operand takes are adjacent bytes (paged_attention.py: _attend).
The attention reads V in whole blocks, slots past a sequence weighted 0, so an FP8 cache never holds NaN or inf:
it starts zeroed (triton_backend.allocate_kv_cache), values past the format's range saturate, and NaN is stored
as 0."""

from __future__ import annotations

import triton
import triton.language as tl

from pagedllm.kernels.fused_ops import rotate_heads, wait_previous_kernel


@triton.jit
def _saturate(x, scale, FP8_MAX: tl.constexpr):
    """x / scale in float32 within the FP8 format's finite range (inf saturates), NaN as 0."""
    y = x.to(tl.float32) / scale
    return tl.where(y != y, 0.0, tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX))


@triton.jit
def write_kv_kernel(
    k_ptr,  # [num_tokens, num_kv_heads, head_dim], heads contiguous within a token
    v_ptr,  # [num_tokens, num_kv_heads, head_dim], heads contiguous within a token
    kv_cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64, -1: padding, skipped
    stride_k_tok,
    stride_v_tok,
    stride_kv,
    stride_blk,
    stride_slot,
    k_scale,  # FP8 cache only: it stores k / k_scale
    v_scale,  # FP8 cache only: it stores v / v_scale
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    ROW_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8_MAX: tl.constexpr,  # 0.0: the cache has the dtype of k/v; else the largest finite value of its FP8 format
):
    """One token per program: its K and V rows into their cache slot (slot -1: nothing)."""
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    offs = tl.arange(0, ROW_PAD)
    ok = (offs < ROW) & (slot >= 0)
    dst = (slot // BLOCK_SIZE) * stride_blk + (slot % BLOCK_SIZE) * stride_slot + offs
    k = tl.load(k_ptr + tok * stride_k_tok + offs, mask=ok)  # [ROW_PAD]
    v = tl.load(v_ptr + tok * stride_v_tok + offs, mask=ok)  # [ROW_PAD]
    if FP8_MAX > 0.0:  # saturate, then round to nearest (as torch's float -> float8 conversion); NaN: 0
        k = _saturate(k, k_scale, FP8_MAX)
        v = _saturate(v, v_scale, FP8_MAX)
        in_blk = (offs // HEAD_DIM) * HEAD_DIM * BLOCK_SIZE + (offs % HEAD_DIM) * BLOCK_SIZE + slot % BLOCK_SIZE
        v_dst = (slot // BLOCK_SIZE) * stride_blk + in_blk  # V transposed within the block
    else:
        v_dst = dst
    tl.store(kv_cache_ptr + dst, k.to(kv_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(kv_cache_ptr + stride_kv + v_dst, v.to(kv_cache_ptr.dtype.element_ty), mask=ok)


@triton.jit
def rotary_write_kv_kernel(
    q_ptr,  # [num_tokens, NUM_Q, head_dim] (any token and head strides)
    k_ptr,  # [num_tokens, NUM_K, head_dim]
    v_ptr,  # [num_tokens, NUM_K, head_dim]
    cos_ptr,  # [num_tokens, 1, HALF]
    sin_ptr,  # [num_tokens, 1, HALF]
    q_w_ptr,  # [head_dim] (HAS_NORM)
    k_w_ptr,  # [head_dim] (HAS_NORM)
    q_out_ptr,  # [num_tokens, NUM_Q, head_dim] contiguous
    kv_cache_ptr,  # [2, num_blocks, block_size, NUM_K, head_dim], rows contiguous
    slot_mapping_ptr,  # [num_tokens] int64, -1: padding, k/v not written
    eps,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_cos,
    stride_sin,
    stride_kv,
    stride_blk,
    stride_slot,
    k_scale,  # FP8 cache only: it stores k / k_scale
    v_scale,  # FP8 cache only: it stores v / v_scale
    NUM_Q: tl.constexpr,
    NUM_Q_PAD: tl.constexpr,
    NUM_K: tl.constexpr,
    NUM_K_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HAS_NORM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8_MAX: tl.constexpr,  # 0.0: the cache has the dtype of k/v; else the largest finite value of its FP8 format
    USE_PDL: tl.constexpr,  # (kernels/__init__.py: pdl)
):
    """One token per program: rotary (after the per-head norm) of its q heads into q_out, and of its k heads, which
    go with its v heads straight into the cache slot (qk_rotary then write_kv_kernel in one launch)."""
    wait_previous_kernel(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, HALF_PAD)
    d_ok = offs < HALF
    cos = tl.load(cos_ptr + tok * stride_cos + offs, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + tok * stride_sin + offs, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    q_heads = tl.arange(0, NUM_Q_PAD)
    q_ok = (q_heads < NUM_Q)[:, None] & d_ok[None, :]
    q1, q2 = rotate_heads(
        q_ptr + tok * stride_q_tok, stride_q_head, q_w_ptr, cos, sin, eps, NUM_Q_PAD, HALF, HALF_PAD, HAS_NORM, q_ok
    )  # fmt: skip
    q_off = tok * NUM_Q * 2 * HALF + q_heads[:, None] * 2 * HALF + offs[None, :]
    tl.store(q_out_ptr + q_off, q1, mask=q_ok)
    tl.store(q_out_ptr + q_off + HALF, q2, mask=q_ok)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot >= 0:
        k_heads = tl.arange(0, NUM_K_PAD)
        ok = (k_heads < NUM_K)[:, None] & d_ok[None, :]
        k1, k2 = rotate_heads(
            k_ptr + tok * stride_k_tok, stride_k_head, k_w_ptr, cos, sin, eps, NUM_K_PAD, HALF, HALF_PAD, HAS_NORM, ok
        )  # fmt: skip
        v_off = tok * stride_v_tok + k_heads[:, None] * stride_v_head + offs[None, :]
        v1 = tl.load(v_ptr + v_off, mask=ok)
        v2 = tl.load(v_ptr + v_off + HALF, mask=ok)
        if FP8_MAX > 0.0:  # as write_kv_kernel
            k1, k2 = _saturate(k1, k_scale, FP8_MAX), _saturate(k2, k_scale, FP8_MAX)
            v1, v2 = _saturate(v1, v_scale, FP8_MAX), _saturate(v2, v_scale, FP8_MAX)
        dst = (slot // BLOCK_SIZE) * stride_blk + (slot % BLOCK_SIZE) * stride_slot
        dst = dst + k_heads[:, None] * 2 * HALF + offs[None, :]  # [NUM_K_PAD, HALF_PAD]
        v_dst, v_half = dst, HALF
        if FP8_MAX > 0.0:  # V transposed within the block (as write_kv_kernel)
            v_dst = (slot // BLOCK_SIZE) * stride_blk + slot % BLOCK_SIZE
            v_dst = v_dst + k_heads[:, None] * 2 * HALF * BLOCK_SIZE + offs[None, :] * BLOCK_SIZE
            v_half = HALF * BLOCK_SIZE
        ty = kv_cache_ptr.dtype.element_ty
        tl.store(kv_cache_ptr + dst, k1.to(ty), mask=ok)
        tl.store(kv_cache_ptr + dst + HALF, k2.to(ty), mask=ok)
        tl.store(kv_cache_ptr + stride_kv + v_dst, v1.to(ty), mask=ok)
        tl.store(kv_cache_ptr + stride_kv + v_dst + v_half, v2.to(ty), mask=ok)
