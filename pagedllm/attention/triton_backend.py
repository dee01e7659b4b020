"""The GPU attention backend: Triton kernels over the paged cache (pagedllm.kernels.paged_attention).

Same interface as the torch backend: `build_metadata(layout)` once per step (every tensor on the device, built from
the host arrays of the layout, so no host sync happens inside the forward), then `forward(q, k, v, kv_cache, meta,
scale, sliding_window, logits_soft_cap=None, alibi_slopes=None, rope=None, qk_norm=None)` per layer: one launch
writes the new K/V to the cache (rotating q and k first when `rope` is given), one launch of the unified kernel
attends for all prefill chunks and decodes of the batch; with split-K its last programs merge the splits (a reduce
launch only while a CUDA graph is captured and the counter buffer would have to grow).

An FP8 cache (kv_cache_dtype fp8 / fp8_e4m3 / fp8_e5m2) holds K / k_scale and V / v_scale with per-tensor scales
(`forward(..., k_scale=, v_scale=)`): the write quantizes, the attention kernel dequantizes as it loads. It keeps V
transposed within each block (kernels/kv_write.py); `cache_to_slot_major` / `slot_major_to_cache` convert."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention.common import BatchLayout
from pagedllm.device import to_device
from pagedllm.kernels import SplitCounters, interpreting, pdl
from pagedllm.kernels.kv_write import rotary_write_kv_kernel, write_kv_kernel
from pagedllm.kernels.paged_attention import reduce_splits_kernel, unified_attention_kernel

SUPPORTS_CUDA_GRAPHS = True  # its metadata can live in static buffers; nothing reads them on the host
SUPPORTS_FUSED_ROTARY = True  # forward(..., rope=) rotates q and k while writing the cache (one launch)
SPLIT_IN_KERNEL = True  # split-K merged by the attention kernel's last programs, not by reduce_splits_kernel
REDUCE_ROWS = 16  # (token, head) rows per reduce_splits_kernel program
MIN_TOKENS_PER_SPLIT = 128  # a split-K run covers at least this many keys (H100 sweep: see RESULTS.md)
MAX_SPLITS = 32  # a power of two (the merge loads a row's split sums as one vector of this width)
DEFAULT_NUM_SMS = 132  # when no CUDA device can be asked (the interpreter on CPU)
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}  # largest finite value of each FP8 cache dtype


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64 cache slot of each new token (-1: padding, not written)
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32 context + query length
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    block_size: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    num_splits: int | None = None  # None: chosen by `choose_num_splits`; set to force (tests, benchmarks)
    block_n: int | None = None  # None: the default key tile; set to force (tests)


def allocate_kv_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[2, num_blocks, block_size, num_kv_heads, head_dim], contiguous (a token's heads side by side, written in one
    store). The kernels mask K past each length, and V too in a slot-major cache, so empty is enough there; an FP8
    cache's V is read in whole blocks (slots past a length weighted 0), so it starts zeroed, finite everywhere."""
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    if dtype in FP8_MAX:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def v_transposed(kv_cache: torch.Tensor) -> bool:
    """Whether the cache keeps V transposed within each block: [num_kv_heads, head_dim, block_size] (FP8 caches)."""
    return kv_cache.dtype in FP8_MAX


def _slot_major_v(kv_cache: torch.Tensor) -> torch.Tensor:
    """The V half as [num_blocks, block_size, num_kv_heads, head_dim] (a view; strided where V is transposed)."""
    v = kv_cache[1]
    if not v_transposed(kv_cache):
        return v
    num_blocks, block_size, heads, head_dim = v.shape
    return v.view(num_blocks, heads, head_dim, block_size).permute(0, 3, 1, 2)


def cache_to_slot_major(kv_cache: torch.Tensor) -> torch.Tensor:
    """[2, num_blocks, block_size, num_kv_heads, head_dim] in slot-major order (a copy where V is transposed)."""
    return torch.stack([kv_cache[0], _slot_major_v(kv_cache)]) if v_transposed(kv_cache) else kv_cache


def slot_major_to_cache(kv: torch.Tensor) -> torch.Tensor:
    """A slot-major [2, num_blocks, block_size, num_kv_heads, head_dim] in this backend's cache layout (a copy where
    V is transposed)."""
    if not v_transposed(kv):
        return kv
    v = kv[1].permute(0, 2, 3, 1).contiguous().view(kv.shape[1:])  # the bytes of [blocks, heads, dim, block_size]
    return torch.stack([kv[0], v])


def read_kv(kv_cache: torch.Tensor, slots: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached K and V of `slots` [n], each [n, num_kv_heads, head_dim] (copies; an FP8 cache's stored values)."""
    k = kv_cache[0].flatten(0, 1).index_select(0, slots)
    v = _slot_major_v(kv_cache).flatten(0, 1).index_select(0, slots)  # (a copy of the strided view where needed)
    return k, v


def build_metadata(layout: BatchLayout) -> TritonAttentionMetadata:
    dev = layout.device
    qsl, seq_lens = layout.query_start_loc, layout.seq_lens
    return TritonAttentionMetadata(
        slot_mapping=layout.slot_mapping.to(dev),
        query_start_loc=to_device(qsl, dev, np.int32),
        seq_lens=to_device(seq_lens, dev, np.int32),
        block_table=to_device(layout.block_table, dev, np.int32),
        block_size=layout.block_size,
        num_reqs=len(seq_lens),
        max_query_len=int(layout.query_lens.max()) if len(seq_lens) else 0,
        max_seq_len=int(seq_lens.max()) if len(seq_lens) else 0,
    )


def static_decode_metadata(
    slot_mapping,
    query_start_loc,
    seq_lens,
    block_table,
    block_size: int,
    max_seq_len: int,
    num_splits: int,
    max_query_len: int = 1,
) -> TritonAttentionMetadata:
    """The metadata of a CUDA-graph batch over static device buffers: max_query_len query tokens per request (1: a
    decode; more: a verify batch, whose launch grid depends only on the token count and the batch size)."""
    return TritonAttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=block_table,
        block_size=block_size,
        num_reqs=len(seq_lens),
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        num_splits=num_splits,
    )


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def choose_num_splits(num_programs: int, max_seq_len: int, max_query_len: int, sms: int) -> int:
    """Split-K when the batch is decodes only and fewer than two waves of programs (one per request and KV head)
    cover the GPU's SMs: enough splits for ~2 waves, each split covering at least MIN_TOKENS_PER_SPLIT keys.
    (Measured on an H200, 16/8 heads, dim 128: 32 x 2k decodes 12% faster with 2 splits, 64 x 1k none faster.)"""
    if max_query_len != 1 or num_programs >= 2 * sms or max_seq_len < 2 * MIN_TOKENS_PER_SPLIT:
        return 1
    by_occupancy = -(-2 * sms // num_programs)
    by_length = max_seq_len // MIN_TOKENS_PER_SPLIT
    return max(1, min(MAX_SPLITS, by_occupancy, by_length))


# prefill tiles by HEAD_DIM_PAD: (BLOCK_M rows, BLOCK_N, num_warps, num_stages), BLOCK_M = BLOCK_Q query tokens x
# the GROUP heads of one KV head (BLOCK_Q = rows // GROUP); a head dim not listed takes the rule in `_tiles`.
# benchmarks/attention_kernels.py --sweep times a grid of these and prints the best as a line for this table.
PREFILL_TILES: dict[int, tuple[int, int, int, int]] = {}


# decode tiles for head dims up to 128, by whether the cache is FP8: (BLOCK_N keys, num_warps, num_stages).
# bfloat16 (H100, Llama-3.1-8B's heads per rank, 256 decodes over 100..2047 keys): 128 keys, 4 warps, 3 stages;
# against 64 keys and 2 warps TP=2's 16/4 heads 15% faster, TP=1's 32/8 heads 1%. FP8 (H200, 32/8 heads, the V^T
# path): 128 keys, 2 warps, 2 stages; against the bfloat16 tiles 5% faster on 256 mixed decodes, 8% on 64, 9% on
# 256 x 1k, 23% on 32 x 8k, 3% slower on 128 mixed (scratch sweep of 27 configs over six batches).
DECODE_TILES: dict[bool, tuple[int, int, int]] = {False: (128, 4, 3), True: (128, 2, 2)}


def _tiles(group: int, max_query_len: int, head_dim_pad: int, fp8_cache: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_Q, BLOCK_M, BLOCK_N, num_warps, num_stages). Decodes: one query token per program, 16+ rows for
    tl.dot; head dims up to 128: DECODE_TILES, larger ones 32 keys, 2 warps.
    Prefill: PREFILL_TILES, else about 64 rows (query tokens x heads of one KV group)."""
    if max_query_len == 1:
        block_n, num_warps, num_stages = DECODE_TILES[fp8_cache] if head_dim_pad <= 128 else (32, 2, 3)
        return 1, max(16, triton_next_pow2(group)), block_n, num_warps, num_stages
    rows, block_n, num_warps, num_stages = PREFILL_TILES.get(head_dim_pad, (64, 0, 0, 2))
    block_q = max(1, rows // group)
    block_m = max(16, triton_next_pow2(block_q * group))
    block_n = block_n or (64 if head_dim_pad <= 128 else 32)
    num_warps = num_warps or (8 if block_m * head_dim_pad >= 128 * 128 else 4)
    return block_q, block_m, block_n, num_warps, num_stages


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(n)))


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """k/v [num_tokens, num_kv_heads, head_dim] into their slots of kv_cache; slot -1 is skipped. An FP8 cache
    stores k / k_scale and v / v_scale, saturated to the format's range."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k = k if k.stride(2) == 1 and k.stride(1) == head_dim else k.contiguous()
    v = v if v.stride(2) == 1 and v.stride(1) == head_dim else v.contiguous()
    assert kv_cache.stride(4) == 1 and kv_cache.stride(3) == head_dim, "cache rows must be contiguous"
    row = num_kv_heads * head_dim
    write_kv_kernel[(num_tokens,)](
        k,
        v,
        kv_cache,
        slot_mapping,
        k.stride(0),
        v.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        float(k_scale),
        float(v_scale),
        ROW=row,
        ROW_PAD=triton_next_pow2(row),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=kv_cache.shape[2],
        FP8_MAX=FP8_MAX.get(kv_cache.dtype, 0.0),
    )


_split = SplitCounters()
_counters, _outgrown = _split.buffers, _split.outgrown
split_counters = _split.take  # (device, at least n) -> zeroed counters, or None while capturing a graph


def rotary_write_kv(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [num_tokens, 1, head_dim // 2]
    qk_norm: tuple | None = None,  # (q weight [head_dim], k weight [head_dim], eps): per-head RMSNorm first
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # rotated q [num_tokens, num_heads, head_dim], contiguous
    """fused_ops.qk_rotary then write_kv in one launch (the same bits): k is rotated straight into the cache."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, half = k.shape[1], head_dim // 2
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    cos, sin = (x if x.stride(-1) == 1 else x.contiguous() for x in rope)
    assert kv_cache.stride(4) == 1 and kv_cache.stride(3) == head_dim, "cache rows must be contiguous"
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    q_w, k_w, eps = qk_norm if qk_norm is not None else (q, k, 0.0)  # unused without the norm
    if num_tokens:
        rotary_write_kv_kernel[(num_tokens,)](
            q, k, v, cos, sin, q_w, k_w, q_out, kv_cache, slot_mapping, float(eps),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
            sin.stride(0), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), float(k_scale), float(v_scale),
            NUM_Q=num_heads, NUM_Q_PAD=triton_next_pow2(num_heads), NUM_K=num_kv_heads,
            NUM_K_PAD=triton_next_pow2(num_kv_heads), HALF=half, HALF_PAD=triton_next_pow2(half),
            HAS_NORM=qk_norm is not None, BLOCK_SIZE=kv_cache.shape[2], FP8_MAX=FP8_MAX.get(kv_cache.dtype, 0.0),
            num_warps=4, **pdl(q),
        )  # fmt: skip
    return q_out


def forward(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: TritonAttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,  # [num_heads] float32
    k_scale: float = 1.0,  # FP8 cache only: its per-tensor scales
    v_scale: float = 1.0,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,  # cos, sin: q and k not rotated yet (rotary_write_kv)
    qk_norm: tuple | None = None,  # with rope: (q weight, k weight, eps) of a per-head RMSNorm before the rotary
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    if kv_cache.dtype not in FP8_MAX:
        k_scale = v_scale = 1.0
    if rope is not None:
        q = rotary_write_kv(q, k, v, kv_cache, meta.slot_mapping, rope, qk_norm, k_scale, v_scale)
    else:
        write_kv(k, v, kv_cache, meta.slot_mapping, k_scale, v_scale)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or meta.num_reqs == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    group = num_heads // num_kv_heads
    head_dim_pad = max(16, triton_next_pow2(head_dim))
    block_q, block_m, block_n, num_warps, num_stages = _tiles(
        group, meta.max_query_len, head_dim_pad, kv_cache.dtype in FP8_MAX
    )
    block_n = meta.block_n or block_n
    num_programs = num_tokens if block_q == 1 else num_tokens // block_q + meta.num_reqs
    num_splits = meta.num_splits or choose_num_splits(
        num_programs * num_kv_heads, meta.max_seq_len, meta.max_query_len, num_sms(q.device)
    )
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits={num_splits}: the attention kernel splits a key range 1..{MAX_SPLITS} ways")
    part_out = part_lse = counters = out  # unused placeholders when there is no split
    split_mode = 0
    if num_splits > 1:
        part_out = torch.empty(
            (num_tokens, num_heads, num_splits, head_dim_pad), dtype=torch.float32, device=q.device
        )  # [num_tokens, num_heads, num_splits, head_dim_pad]
        part_lse = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=q.device)
        found = split_counters(q.device, num_programs * num_kv_heads) if SPLIT_IN_KERNEL else None
        split_mode = 1 if found is None else 2
        counters = out if found is None else found
    tiles = (block_q, block_m, block_n, num_warps, num_stages)
    extras = (sliding_window, logits_soft_cap, alibi_slopes, v_scale)
    grid = (num_programs, num_kv_heads, num_splits)
    # q . (k_scale * k8) = k_scale * (q . k8): k_scale joins the score scale
    outs = (out, part_out, part_lse, counters)
    _launch_unified(outs, q, kv_cache, meta, scale * k_scale, extras, tiles, grid, split_mode)
    if split_mode == 1:
        num_rows = num_tokens * num_heads
        reduce_splits_kernel[(triton_cdiv(num_rows, REDUCE_ROWS),)](
            out, part_out, part_lse, num_rows, num_heads, num_splits, out.stride(0), out.stride(1),
            BLOCK_R=REDUCE_ROWS, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, SPLITS_PAD=MAX_SPLITS,
        )  # fmt: skip
    return out


def fp8_in_float16(cache_dtype: torch.dtype, q: torch.Tensor) -> bool:
    """The attention kernel's Q_F16: an FP8 cache read by half-precision queries on a GPU with the FP8 -> float16
    pair conversion (compute capability 8.9+), compiled (not under Triton's interpreter)."""
    if cache_dtype not in FP8_MAX or q.dtype == torch.float32 or not q.is_cuda or interpreting():
        return False
    return torch.cuda.get_device_capability(q.device) >= (8, 9)


def _launch_unified(outs, q, kv_cache, meta, scale, extras, tiles, grid: tuple[int, int, int], split: int) -> None:
    """The attention kernel over the flat batch: outs = (out, partial outputs, partial log-sum-exps, split counters
    (split 2) or a placeholder), extras = (sliding window, logit soft-cap, ALiBi slopes, the output's scale), tiles =
    (BLOCK_Q, BLOCK_M, BLOCK_N, warps, stages), grid = (programs, KV heads, splits), split = the kernel's SPLIT."""
    out, part_out, part_lse, counters = outs
    sliding_window, logits_soft_cap, alibi_slopes, out_scale = extras
    block_q, block_m, block_n, num_warps, num_stages = tiles
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_splits = grid[2]
    unified_attention_kernel[grid](
        out,
        part_out,
        part_lse,
        counters,
        q,
        kv_cache,
        meta.block_table,
        meta.query_start_loc,
        meta.seq_lens,
        meta.num_reqs,
        num_heads,
        scale * math.log2(math.e),
        scale / logits_soft_cap if logits_soft_cap else 0.0,
        logits_soft_cap * math.log2(math.e) if logits_soft_cap else 0.0,
        alibi_slopes if alibi_slopes is not None else q,  # q: an unused placeholder
        sliding_window or 0,
        num_splits,
        float(out_scale),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        meta.block_table.stride(0),
        GROUP=num_heads // grid[1],
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton_next_pow2(head_dim)),
        BLOCK_SIZE=kv_cache.shape[2],
        SPLIT=split,
        MIN_SPLIT_TILES=max(1, MIN_TOKENS_PER_SPLIT // block_n),
        SPLITS_PAD=MAX_SPLITS,
        USE_WINDOW=sliding_window is not None,
        USE_SOFTCAP=bool(logits_soft_cap),
        USE_ALIBI=alibi_slopes is not None,
        IEEE=q.dtype == torch.float32,
        Q_F16=fp8_in_float16(kv_cache.dtype, q),
        V_T=v_transposed(kv_cache),
        num_warps=num_warps,
        **pdl(q),
        num_stages=num_stages,
    )
