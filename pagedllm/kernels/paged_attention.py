"""Paged attention in Triton: one kernel for varlen prefill chunks and decodes over the paged KV cache, and its
split-K (flash-decoding) reduce. The cache write (and its layout) is in kv_write.py.

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

FP8 KV cache: the cache holds K / k_scale and V / v_scale in FP8 (per-tensor scales), V transposed within each block
(kv_write.py). The attention kernel widens each loaded tile to the query's dtype (on compute capability 8.9+ to
float16, the query cast to float16 once) by a plain cast, which Triton places after its shared-memory load, in the
dot operand's registers: the operand's pairs lie along the head dim for K and along the keys for V, adjacent bytes
in both layouts, so one packed `cvt` widens a pair and no tile goes through shared memory twice (V in the
slot-major layout, widened in PTX where loaded and stored again: 8-19% slower decodes on an H200). V is read in
whole blocks: slots past a sequence in its last block weigh 0, and hold finite values (kv_write.py), so they add 0.
k_scale is folded into the score scale by the caller and v_scale multiplies the output (both linear, so
the tiles need no per-element multiply)."""

from __future__ import annotations

import triton
import triton.language as tl

from pagedllm.kernels.fused_ops import wait_previous_kernel


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
def _attend(
    acc,  # [BLOCK_M, HEAD_DIM_PAD] fp32
    l_i,  # [BLOCK_M] fp32
    m_i,  # [BLOCK_M] fp32, log2 domain
    q,  # [BLOCK_M, HEAD_DIM_PAD]
    q_pos,  # [BLOCK_M]
    slopes_log2,  # [BLOCK_M] (USE_ALIBI only)
    k_base,
    v_base,  # V of this KV head: the cache's V half + the head's offset (within a block: V_T's or slot-major's)
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
    V_T: tl.constexpr,  # V transposed within each block (an FP8 cache: kv_write.py)
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
        if MASK or HEAD_DIM != HEAD_DIM_PAD:  # (an FP8 cache widens in the dot operand's registers)
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
        if V_T and BLOCK_N % BLOCK_SIZE == 0:  # whole blocks: each one's [HEAD_DIM, BLOCK_SIZE] run loaded whole
            NB: tl.constexpr = BLOCK_N // BLOCK_SIZE
            offs_b = tl.arange(0, NB)
            offs_c = tl.arange(0, HEAD_DIM_PAD * BLOCK_SIZE)  # d * BLOCK_SIZE + slot
            c_ok = (offs_c < HEAD_DIM * BLOCK_SIZE)[None, :]
            if MASK:
                b_ok = kv_start + offs_b * BLOCK_SIZE < hi
                blk_b = tl.load(bt_row + kv_start // BLOCK_SIZE + offs_b, mask=b_ok, other=0).to(tl.int64)
                vt_ptr = v_base + blk_b[:, None] * stride_blk + offs_c[None, :]  # [NB, HEAD_DIM_PAD * BLOCK_SIZE]
                vt = tl.load(vt_ptr, mask=b_ok[:, None] & c_ok, other=0.0)
            else:
                blk_b = tl.load(bt_row + kv_start // BLOCK_SIZE + offs_b).to(tl.int64)
                vt_ptr = v_base + blk_b[:, None] * stride_blk + offs_c[None, :]
                vt = tl.load(vt_ptr, mask=c_ok, other=0.0) if HEAD_DIM != HEAD_DIM_PAD else tl.load(vt_ptr)
            vt = tl.permute(tl.reshape(vt, (NB, HEAD_DIM_PAD, BLOCK_SIZE)), (0, 2, 1))
            v = tl.reshape(vt, (BLOCK_N, HEAD_DIM_PAD)).to(q.dtype)
        else:  # slot-major, or V_T with a tile inside one block
            if V_T:
                v_off = (blk * stride_blk + kv_pos % BLOCK_SIZE)[:, None] + offs_d[None, :] * BLOCK_SIZE
            else:
                v_off = slot_off[:, None] + offs_d[None, :]
            if MASK or HEAD_DIM != HEAD_DIM_PAD:  # [BLOCK_N, HEAD_DIM_PAD]
                v = tl.load(v_base + v_off, mask=v_mask, other=0.0).to(q.dtype)
            else:
                v = tl.load(v_base + v_off).to(q.dtype)
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
    Q_F16: tl.constexpr,  # an FP8 cache read in float16 (compute capability 8.9+): the query cast to float16 once
    V_T: tl.constexpr,  # V transposed within each block (an FP8 cache: kv_write.py)
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
    if Q_F16:  # the products run in float16 (float32 sums): a bfloat16 query clamped to its range once
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
    v_base = kv_cache_ptr + stride_kv + kv_head * stride_kv_head * (BLOCK_SIZE if V_T else 1)
    if not USE_ALIBI:
        slopes_log2 = q_pos.to(tl.float32)  # unused placeholder
    if BLOCK_Q == 1 and V_T and not USE_WINDOW:  # decodes over an FP8 cache: whole tiles unmasked, then the rest
        full = lo + (hi - lo) // BLOCK_N * BLOCK_N
        acc, l_i, m_i = _attend(
            acc, l_i, m_i, q, q_pos, slopes_log2, k_base, v_base, bt_row, offs_d, d_ok, lo, full, hi,
            stride_kv, stride_blk, stride_slot, scale_log2, softcap_scale, softcap_log2, sliding_window,
            False, BLOCK_N, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, USE_WINDOW, USE_SOFTCAP, USE_ALIBI, IEEE, V_T,
        )  # fmt: skip
        acc, l_i, m_i = _attend(
            acc, l_i, m_i, q, q_pos, slopes_log2, k_base, v_base, bt_row, offs_d, d_ok, full, hi, hi,
            stride_kv, stride_blk, stride_slot, scale_log2, softcap_scale, softcap_log2, sliding_window,
            True, BLOCK_N, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, USE_WINDOW, USE_SOFTCAP, USE_ALIBI, IEEE, V_T,
        )  # fmt: skip
    elif BLOCK_Q == 1:  # decodes: one masked run, as their programs hold a tile or a few
        acc, l_i, m_i = _attend(
            acc, l_i, m_i, q, q_pos, slopes_log2, k_base, v_base, bt_row, offs_d, d_ok, lo, hi, hi,
            stride_kv, stride_blk, stride_slot, scale_log2, softcap_scale, softcap_log2, sliding_window,
            True, BLOCK_N, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, USE_WINDOW, USE_SOFTCAP, USE_ALIBI, IEEE, V_T,
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
                acc, l_i, m_i, q, q_pos, slopes_log2, k_base, v_base, bt_row, offs_d, d_ok, lo, mid_lo, hi,
                stride_kv, stride_blk, stride_slot, scale_log2, softcap_scale, softcap_log2, sliding_window,
                True, BLOCK_N, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, USE_WINDOW, USE_SOFTCAP, USE_ALIBI, IEEE, V_T,
            )  # fmt: skip
        acc, l_i, m_i = _attend(
            acc, l_i, m_i, q, q_pos, slopes_log2, k_base, v_base, bt_row, offs_d, d_ok, mid_lo, mid_hi, hi,
            stride_kv, stride_blk, stride_slot, scale_log2, softcap_scale, softcap_log2, sliding_window,
            False, BLOCK_N, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, USE_WINDOW, USE_SOFTCAP, USE_ALIBI, IEEE, V_T,
        )  # fmt: skip
        acc, l_i, m_i = _attend(
            acc, l_i, m_i, q, q_pos, slopes_log2, k_base, v_base, bt_row, offs_d, d_ok, mid_hi, hi, hi,
            stride_kv, stride_blk, stride_slot, scale_log2, softcap_scale, softcap_log2, sliding_window,
            True, BLOCK_N, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, USE_WINDOW, USE_SOFTCAP, USE_ALIBI, IEEE, V_T,
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
