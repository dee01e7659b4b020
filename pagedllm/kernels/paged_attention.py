"""Paged attention in Triton: one kernel for varlen prefill chunks and decodes over the paged KV cache, its
split-K (flash-decoding) reduce, and the KV-cache write (`write_kv_kernel`, or `rotary_write_kv_kernel`, which first
applies the rotary, and Qwen3's per-head q/k norm, to q and k: one launch instead of two).

Tiling. A program owns BLOCK_Q query tokens of one request and all GROUP query heads that share one KV head, so its
tile has BLOCK_M = next_pow2(BLOCK_Q * GROUP) rows (row r: token r // GROUP, head r % GROUP); each K/V tile of
BLOCK_N keys is loaded once for all those heads. Keys are gathered through the block table, BLOCK_N // block_size
cache blocks (or part of one) per iteration. Softmax is online in fp32 in the log2 domain.
Prefill programs (BLOCK_Q > 1) split their key range: tiles wholly before the tile's first query and inside every
row's window skip the causal mask (no tl.where, no bounds masks); the diagonal tiles, the window's lower edge and a
range's ragged end keep it. Decode programs (BLOCK_Q == 1) run one masked loop.

Which request a program serves is found on the device by a binary search over query_start_loc: request i owns
program ids [start(i), start(i + 1)) with start(i) = qsl[i] // BLOCK_Q + i (an upper bound of its q blocks; the
extra program exits at once), or start(i) = qsl[i] when BLOCK_Q == 1. No host data beyond the grid size is needed.

Split-K: with SPLIT the third grid axis splits each request's key range into runs of equal tile counts, at
most num_splits and at least MIN_SPLIT_TILES tiles each (a short context uses fewer splits than the grid has: the
grid is fixed when a CUDA graph is captured); each writes its normalized partial output and log2-sum-exp. The last
split holding keys of a (program, KV head) to finish (an atomic counter per pair, re-zeroed by that program)
combines them, and the splits past the keys exit at once; without a counter buffer every split writes (-inf for
none) and `reduce_splits_kernel` combines them in a second launch (the same arithmetic, so the same bits).

FP8 KV cache: the cache holds K / k_scale and V / v_scale in FP8 (per-tensor scales, written by `write_kv_kernel`).
The attention kernel widens each loaded tile to the query's dtype (on compute capability 8.9+ to float16, the query
cast to float16 once; V in inline PTX: `_widen`); k_scale is folded into the score scale by the caller and v_scale
multiplies the output (both are linear, so the tiles need no per-element multiply)."""

from __future__ import annotations

import triton
import triton.language as tl

from pagedllm.kernels.fused_ops import rotate_heads, wait_previous_kernel


@triton.jit
def _find_request(query_start_loc_ptr, num_reqs, pid, BLOCK_Q: tl.constexpr):
    """The request i with start(i) <= pid < start(i + 1), by binary search; also returns start(i)."""
    lo = 0
    hi = num_reqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        start = tl.load(query_start_loc_ptr + mid)
        if BLOCK_Q > 1:
            start = start // BLOCK_Q + mid
        if start <= pid:
            lo = mid
        else:
            hi = mid - 1
    start = tl.load(query_start_loc_ptr + lo)
    if BLOCK_Q > 1:
        start = start // BLOCK_Q + lo
    return lo, start


@triton.jit
def _widen(x, dtype: tl.constexpr, FP8_PTX: tl.constexpr):
    """A loaded V tile in the compute dtype. FP8_PTX (an FP8 cache on compute capability 8.9+, float16 compute):
    four FP8 values a register widen to float16 with one `cvt` per pair, in inline PTX that the compiler keeps where
    it stands, right after the load. A plain cast sinks past tl.dot's shared-memory staging and widens in the dot
    operand's registers: right for K (its operand pairs lie along the head dim, adjacent bytes: one packed `cvt` a
    pair, no second trip through shared memory), wrong for V, whose pairs lie along the keys, so that each byte is
    read from shared memory apart (offline sm_90 SASS: 128 byte loads a thread and tile). 1: e4m3, 2: e5m2."""
    if FP8_PTX == 1:
        y = tl.inline_asm_elementwise(
            asm="{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            constraints="=r,=r,r", args=[x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4,
        )  # fmt: skip
    elif FP8_PTX == 2:
        y = tl.inline_asm_elementwise(
            asm="{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e5m2x2 $0, lo; cvt.rn.f16x2.e5m2x2 $1, hi; }",
            constraints="=r,=r,r", args=[x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4,
        )  # fmt: skip
    else:
        y = x.to(dtype)
    return y


@triton.jit
def _attend(
    acc,  # [BLOCK_M, HEAD_DIM_PAD] fp32
    l_i,  # [BLOCK_M] fp32
    m_i,  # [BLOCK_M] fp32, log2 domain
    q,  # [BLOCK_M, HEAD_DIM_PAD]
    q_pos,  # [BLOCK_M]
    slopes_log2,  # [BLOCK_M] (USE_ALIBI only)
    k_base,
    bt_row,
    offs_d,
    d_ok,
    tile_lo,
    tile_hi,
    hi,  # keys at hi and after are hidden (MASK only)
    stride_kv,
    stride_blk,
    stride_slot,
    scale_log2,
    softcap_scale,
    softcap_log2,
    sliding_window,
    MASK: tl.constexpr,  # False: every key of tiles [tile_lo, tile_hi) is visible to every row
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    IEEE: tl.constexpr,
    FP8_PTX: tl.constexpr,
):
    """The online softmax over the key tiles starting at tile_lo, tile_lo + BLOCK_N, ... below tile_hi."""
    for kv_start in range(tile_lo, tile_hi, BLOCK_N):
        kv_pos = kv_start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        if MASK:
            kv_ok = kv_pos < hi
            blk = tl.load(bt_row + kv_pos // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
            k_mask = kv_ok[None, :] & d_ok[:, None]
            v_mask = kv_ok[:, None] & d_ok[None, :]
        else:
            blk = tl.load(bt_row + kv_pos // BLOCK_SIZE).to(tl.int64)
            k_mask = d_ok[:, None] & (kv_pos >= 0)[None, :]
            v_mask = (kv_pos >= 0)[:, None] & d_ok[None, :]
        slot_off = blk * stride_blk + (kv_pos % BLOCK_SIZE) * stride_slot  # [BLOCK_N]
        k_ptr = k_base + slot_off[None, :] + offs_d[:, None]  # [HEAD_DIM_PAD, BLOCK_N]
        if MASK or HEAD_DIM != HEAD_DIM_PAD:  # an FP8 cache's K widens in the dot's operand layout (see _widen)
            k = tl.load(k_ptr, mask=k_mask, other=0.0).to(q.dtype)
        else:
            k = tl.load(k_ptr).to(q.dtype)
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        if USE_SOFTCAP:  # tanh(x) = 1 - 2 / (exp(2x) + 1), saturating to +-1 without overflow
            s = softcap_log2 * (1.0 - 2.0 / (tl.exp(2.0 * s * softcap_scale) + 1.0))
        else:
            s = s * scale_log2  # [BLOCK_M, BLOCK_N]
        if USE_ALIBI:
            s += slopes_log2[:, None] * (kv_pos[None, :] - q_pos[:, None]).to(tl.float32)
        if MASK:
            visible = (kv_pos[None, :] <= q_pos[:, None]) & kv_ok[None, :]
            if USE_WINDOW:
                visible = visible & (kv_pos[None, :] > q_pos[:, None] - sliding_window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet stay at zero
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptr = k_base + stride_kv + slot_off[:, None] + offs_d[None, :]  # [BLOCK_N, HEAD_DIM_PAD]
        if MASK or HEAD_DIM != HEAD_DIM_PAD:
            v = _widen(tl.load(v_ptr, mask=v_mask, other=0.0), q.dtype, FP8_PTX)
        else:
            v = _widen(tl.load(v_ptr), q.dtype, FP8_PTX)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, l_i, m_i


# one compiled variant for any batch, split count and block-table width (Triton would otherwise compile the value 1
# and multiples of 16 apart, and the eager path's table width changes from step to step)
@triton.jit(do_not_specialize=["num_reqs", "num_splits", "stride_bt"])
def unified_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim] (not SPLIT)
    part_out_ptr,  # [num_tokens, num_heads, num_splits, HEAD_DIM_PAD] fp32 (SPLIT)
    part_lse_ptr,  # [num_tokens, num_heads, num_splits] fp32 (SPLIT)
    cnt_ptr,  # [programs * num_kv_heads] int32, zero (SPLIT == 2): finished splits of each (program, KV head)
    q_ptr,  # [num_tokens, num_heads, head_dim]
    kv_cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_table_ptr,  # [num_reqs, max_blocks] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32
    num_reqs,
    num_heads,
    scale_log2,  # softmax scale * log2(e)
    softcap_scale,  # softmax scale / cap (USE_SOFTCAP only)
    softcap_log2,  # cap * log2(e) (USE_SOFTCAP only)
    alibi_slopes_ptr,  # [num_heads] fp32 (USE_ALIBI only)
    sliding_window,  # keys with q_pos - key_pos >= sliding_window are hidden (USE_WINDOW only)
    num_splits,  # key-range splits (SPLIT only)
    out_scale,  # multiplies the output: v_scale of an FP8 cache, else 1.0
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_kv,
    stride_blk,
    stride_slot,
    stride_kv_head,
    stride_bt,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,  # 0: no split; 1: partials for reduce_splits_kernel; 2: merged by the last program
    MIN_SPLIT_TILES: tl.constexpr,  # (SPLIT) a split covers at least this many key tiles
    SPLITS_PAD: tl.constexpr,  # (SPLIT) a power of two >= num_splits
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,  # scores become cap * tanh(scores / cap)
    USE_ALIBI: tl.constexpr,  # scores gain slope[head] * (key_pos - q_pos)
    IEEE: tl.constexpr,
    FP8_PTX: tl.constexpr,  # 0, or an FP8 cache widened in PTX to float16 (1: e4m3, 2: e5m2); see _widen
    USE_PDL: tl.constexpr,  # (kernels/__init__.py: pdl)
):
    wait_previous_kernel(USE_PDL)
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req, req_start = _find_request(query_start_loc_ptr, num_reqs, pid, BLOCK_Q)
    q_first = (pid - req_start) * BLOCK_Q  # first query index of this tile within the request
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if q_first >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_first + rows // GROUP  # [BLOCK_M] query index within the request
    head = kv_head * GROUP + rows % GROUP  # [BLOCK_M]
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    tok = (q_start + q_idx).to(tl.int64)
    q_off = tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, HEAD_DIM_PAD]
    if FP8_PTX:  # the products run in float16 (float32 sums): a bfloat16 query clamped to its range once
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0, propagate_nan=tl.PropagateNan.ALL).to(tl.float16)
    q_pos = context + q_idx  # [BLOCK_M] absolute position of each row's query
    if USE_ALIBI:
        slopes_log2 = tl.load(alibi_slopes_ptr + head, mask=row_ok, other=0.0) * 1.4426950408889634  # [BLOCK_M]

    hi = context + tl.minimum(q_first + BLOCK_Q, q_len)  # keys [lo, hi) are visible to some row
    q_last = hi - 1  # the last query position of the tile
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(context + q_first - sliding_window + 1, 0) // BLOCK_N * BLOCK_N
    used = 1  # splits holding keys (SPLIT)
    if SPLIT:
        tiles = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N)
        tiles_per_split = tl.maximum(tl.cdiv(tiles, num_splits), MIN_SPLIT_TILES)
        used = tl.maximum(tl.cdiv(tiles, tiles_per_split), 1)
        if SPLIT == 2 and split >= used:  # no keys: nothing to write, and the merge skips it
            return
        lo = lo + split * tiles_per_split * BLOCK_N
        hi = tl.minimum(hi, lo + tiles_per_split * BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    bt_row = block_table_ptr + req * stride_bt
    k_base = kv_cache_ptr + kv_head * stride_kv_head
    if not USE_ALIBI:
        slopes_log2 = q_pos.to(tl.float32)  # unused placeholder
    if BLOCK_Q == 1:  # decodes: one masked run, as their programs hold a tile or a few
        acc, l_i, m_i = _attend(
            acc, l_i, m_i, q, q_pos, slopes_log2, k_base, bt_row, offs_d, d_ok, lo, hi, hi,
            stride_kv, stride_blk, stride_slot, scale_log2, softcap_scale, softcap_log2, sliding_window,
            True, BLOCK_N, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, USE_WINDOW, USE_SOFTCAP, USE_ALIBI, IEEE, FP8_PTX,
        )  # fmt: skip
    else:
        # tiles [mid_lo, mid_hi) hold keys that every row sees (none before a row's window, none after the tile's
        # first query): they skip the mask; the tiles before them (window edge) and after them (diagonal) keep it
        n_tiles = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N)
        full_end = tl.minimum(tl.maximum(context + q_first + 1 - lo, 0) // BLOCK_N, n_tiles)
        full_start = full_end * 0
        if USE_WINDOW:
            full_start = tl.minimum(tl.cdiv(tl.maximum(q_last - sliding_window + 1 - lo, 0), BLOCK_N), n_tiles)
        mid_lo = lo + full_start * BLOCK_N
        mid_hi = lo + tl.maximum(full_end, full_start) * BLOCK_N
        if USE_WINDOW:
            acc, l_i, m_i = _attend(
                acc, l_i, m_i, q, q_pos, slopes_log2, k_base, bt_row, offs_d, d_ok, lo, mid_lo, hi,
                stride_kv, stride_blk, stride_slot, scale_log2, softcap_scale, softcap_log2, sliding_window,
                True, BLOCK_N, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, USE_WINDOW, USE_SOFTCAP, USE_ALIBI, IEEE, FP8_PTX,
            )  # fmt: skip
        acc, l_i, m_i = _attend(
            acc, l_i, m_i, q, q_pos, slopes_log2, k_base, bt_row, offs_d, d_ok, mid_lo, mid_hi, hi,
            stride_kv, stride_blk, stride_slot, scale_log2, softcap_scale, softcap_log2, sliding_window,
            False, BLOCK_N, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, USE_WINDOW, USE_SOFTCAP, USE_ALIBI, IEEE, FP8_PTX,
        )  # fmt: skip
        acc, l_i, m_i = _attend(
            acc, l_i, m_i, q, q_pos, slopes_log2, k_base, bt_row, offs_d, d_ok, mid_hi, hi, hi,
            stride_kv, stride_blk, stride_slot, scale_log2, softcap_scale, softcap_log2, sliding_window,
            True, BLOCK_N, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, USE_WINDOW, USE_SOFTCAP, USE_ALIBI, IEEE, FP8_PTX,
        )  # fmt: skip

    out = acc * (out_scale / tl.where(l_i == 0.0, 1.0, l_i))[:, None]
    if not SPLIT:
        o_off = tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        part = (tok * num_heads + head) * num_splits + split  # [BLOCK_M]
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :], out, mask=row_ok[:, None])
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_ok)
        if SPLIT == 2:  # the (program, KV head)'s last split to finish merges all, then re-zeroes the counter
            tl.debug_barrier()  # every thread's partials stored before the program counts itself done
            cnt = cnt_ptr + pid * tl.num_programs(1) + kv_head
            done = tl.atomic_add(cnt, 1, sem="acq_rel")  # release ours, acquire the others'
            if done == used - 1:
                o_off = tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :]
                _merge_splits(
                    out_ptr, part_out_ptr, part_lse_ptr, part - split, o_off, row_ok, used, offs_d, d_ok,
                    BLOCK_M, HEAD_DIM_PAD, SPLITS_PAD,
                )  # fmt: skip
                tl.atomic_xchg(cnt, 0)


@triton.jit
def _merge_splits(
    out_ptr,
    part_out_ptr,  # [num_tokens, num_heads, num_splits, HEAD_DIM_PAD] fp32
    part_lse_ptr,  # [num_tokens, num_heads, num_splits] fp32
    part_row,  # [R] int64: (token * num_heads + head) * num_splits of each row
    o_off,  # [R, HEAD_DIM_PAD] offsets into out
    row_ok,  # [R]
    num_splits,  # the first num_splits splits of each row are merged
    offs_d,  # [HEAD_DIM_PAD]
    d_ok,  # [HEAD_DIM_PAD]
    R: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # >= num_splits, a power of two
):
    """Combines each row's split partial outputs by their log2-sum-exps: the weights from all the row's sums in one
    load, the outputs added in split order 0, 1, ... elementwise per row, so the reduce kernel and the attention
    kernel's last program give the same bits. Loads bypass L1 (.cg): other programs wrote the partials."""
    cols = tl.arange(0, SPLITS_PAD)
    lse_ptr = part_lse_ptr + part_row[:, None] + cols[None, :]  # [R, SPLITS_PAD]
    lse_ok = row_ok[:, None] & (cols < num_splits)[None, :]
    lse = tl.load(lse_ptr, mask=lse_ok, other=float("-inf"), cache_modifier=".cg")
    m = tl.max(lse, axis=1)  # [R]
    w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m)[:, None]))
    w_sum = tl.sum(w, axis=1)  # [R]; empty splits weigh nothing
    acc = tl.zeros([R, HEAD_DIM_PAD], dtype=tl.float32)
    for s in range(0, num_splits):
        w_s = tl.sum(tl.where(cols[None, :] == s, w, 0.0), axis=1)  # [R]
        part_ptr = part_out_ptr + (part_row + s)[:, None] * HEAD_DIM_PAD + offs_d[None, :]
        acc += tl.load(part_ptr, mask=row_ok[:, None], other=0.0, cache_modifier=".cg") * w_s[:, None]
    out = acc / tl.where(row_ok & (w_sum > 0.0), w_sum, 1.0)[:, None]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["num_rows", "num_splits"])
def reduce_splits_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_out_ptr,  # [num_tokens, num_heads, num_splits, HEAD_DIM_PAD] fp32
    part_lse_ptr,  # [num_tokens, num_heads, num_splits] fp32
    num_rows,  # num_tokens * num_heads
    num_heads,
    num_splits,
    stride_o_tok,
    stride_o_head,
    BLOCK_R: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """Combines the split partial outputs of BLOCK_R (token, head) rows (when the attention kernel's last
    programs cannot: no counter buffer)."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    row_ok = r < num_rows
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    o_off = (r // num_heads)[:, None] * stride_o_tok + (r % num_heads)[:, None] * stride_o_head + offs_d[None, :]
    _merge_splits(
        out_ptr, part_out_ptr, part_lse_ptr, r * num_splits, o_off, row_ok, num_splits, offs_d, offs_d < HEAD_DIM,
        BLOCK_R, HEAD_DIM_PAD, SPLITS_PAD,
    )  # fmt: skip


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
    BLOCK_SIZE: tl.constexpr,
    FP8_MAX: tl.constexpr,  # 0.0: the cache has the dtype of k/v; else the largest finite value of its FP8 format
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    offs = tl.arange(0, ROW_PAD)
    ok = (offs < ROW) & (slot >= 0)
    dst = (slot // BLOCK_SIZE) * stride_blk + (slot % BLOCK_SIZE) * stride_slot + offs
    k = tl.load(k_ptr + tok * stride_k_tok + offs, mask=ok)  # [ROW_PAD]
    v = tl.load(v_ptr + tok * stride_v_tok + offs, mask=ok)  # [ROW_PAD]
    if FP8_MAX > 0.0:  # saturate, then round to nearest (as torch's float -> float8 conversion)
        k = tl.minimum(tl.maximum(k.to(tl.float32) / k_scale, -FP8_MAX), FP8_MAX)
        v = tl.minimum(tl.maximum(v.to(tl.float32) / v_scale, -FP8_MAX), FP8_MAX)
    tl.store(kv_cache_ptr + dst, k.to(kv_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(kv_cache_ptr + stride_kv + dst, v.to(kv_cache_ptr.dtype.element_ty), mask=ok)


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
        if FP8_MAX > 0.0:  # saturate, then round to nearest (as write_kv_kernel)
            k1 = tl.minimum(tl.maximum(k1.to(tl.float32) / k_scale, -FP8_MAX), FP8_MAX)
            k2 = tl.minimum(tl.maximum(k2.to(tl.float32) / k_scale, -FP8_MAX), FP8_MAX)
            v1 = tl.minimum(tl.maximum(v1.to(tl.float32) / v_scale, -FP8_MAX), FP8_MAX)
            v2 = tl.minimum(tl.maximum(v2.to(tl.float32) / v_scale, -FP8_MAX), FP8_MAX)
        dst = (slot // BLOCK_SIZE) * stride_blk + (slot % BLOCK_SIZE) * stride_slot
        dst = dst + k_heads[:, None] * 2 * HALF + offs[None, :]  # [NUM_K_PAD, HALF_PAD]
        ty = kv_cache_ptr.dtype.element_ty
        tl.store(kv_cache_ptr + dst, k1.to(ty), mask=ok)
        tl.store(kv_cache_ptr + dst + HALF, k2.to(ty), mask=ok)
        tl.store(kv_cache_ptr + stride_kv + dst, v1.to(ty), mask=ok)
        tl.store(kv_cache_ptr + stride_kv + dst + HALF, v2.to(ty), mask=ok)
