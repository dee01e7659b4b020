"""Passes over a row of logits for the GPU kernels (pagedllm/kernels/sampling.py, logprobs.py), one program per
row: x / T with NaN, +inf and -0 made orderable, tiles of DEPTH x TILE tokens whose lanes (tokens lane, lane + TILE,
...) keep running values, order-preserving int32 keys of float32 values, lists of the tokens in a key interval, and
a multi-way search for the key where a count or a mass is reached (over a row or over such a list).

A pass keeps per lane running values, reduced once at the end: a row is read from memory once, its later passes hit
L2. An iteration reads DEPTH blocks of TILE tokens, each lane's along its column, so that more loads are in flight."""

from __future__ import annotations

import triton
import triton.language as tl

_FLOAT_MAX = tl.constexpr(3.4028234663852886e38)  # +inf logits become this
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _scaled(x, inv_t):
    """x / T in float32 with NaN -> -inf (never drawn), +inf -> the largest float and -0 -> +0 (equal floats, but
    their keys differ)."""
    s = x.to(tl.float32) * inv_t
    s = tl.where(s == s, s, float("-inf"))
    s = tl.where(s == 0.0, 0.0, s)
    return tl.minimum(s, _FLOAT_MAX)


@triton.jit
def _tokens(row_ptr, idx, vocab, inv_t):
    """x / T of tokens idx, -inf past the vocabulary."""
    return _scaled(tl.load(row_ptr + idx, mask=idx < vocab, other=float("-inf")), inv_t)


@triton.jit
def _tile(row_ptr, start, vocab, inv_t, TILE: tl.constexpr, DEPTH: tl.constexpr):
    """x / T of the DEPTH x TILE tokens from start on, row r lane l holding token start + r TILE + l: each lane's
    tokens lie along its column, so a pass reduces a tile along axis 0 into its per-lane values. Returns the values
    and the tokens. ([DEPTH, TILE], [DEPTH, TILE])"""
    idx = start + tl.arange(0, DEPTH)[:, None] * TILE + tl.arange(0, TILE)[None, :]
    return _tokens(row_ptr, idx, vocab, inv_t), idx


@triton.jit
def _key(s):
    """An int32 that orders as the float32 s does (s not NaN)."""
    bits = s.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _value(key):
    """The float32 of an int32 key (the inverse of _key)."""
    return tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _lane_max(row_ptr, vocab, inv_t, TILE: tl.constexpr, DEPTH: tl.constexpr):
    """The largest x / T of each lane (tokens lane, lane + TILE, ...). [TILE]"""
    top = tl.full([TILE], float("-inf"), tl.float32)
    for start in range(0, vocab, TILE * DEPTH):
        top = tl.maximum(top, tl.max(_tile(row_ptr, start, vocab, inv_t, TILE, DEPTH)[0], 0))
    return top


@triton.jit
def _scores(ptr, idx, n, inv_t, LISTED: tl.constexpr):
    """x / T of entries idx: a row of logits, or (LISTED) a candidate list that holds them already."""
    if LISTED:
        return tl.load(ptr + idx, mask=idx < n, other=float("-inf"))
    return _tokens(ptr, idx, n, inv_t)


@triton.jit
def _at_or_above(
    ptr, n, inv_t, top, pivots, MASS: tl.constexpr, LISTED: tl.constexpr, TILE: tl.constexpr, PIVOTS: tl.constexpr
):
    """For each pivot key: how many entries (MASS: their exp(x / T - top)) have a key >= it. [PIVOTS] float32"""
    acc = tl.zeros([PIVOTS, TILE], tl.float32)  # summed over the lanes once, at the end
    for start in range(0, n, TILE):
        idx = start + tl.arange(0, TILE)
        s = _scores(ptr, idx, n, inv_t, LISTED)
        if MASS:
            w = tl.exp2((s - top) * _LOG2E)  # -inf (and past the end): 0
        else:
            w = tl.where(idx < n, 1.0, 0.0)
        acc += tl.where(_key(s)[None, :] >= pivots[:, None], w[None, :], 0.0)
    return tl.sum(acc, axis=1)


@triton.jit
def _pivots(lo, hi, PIVOTS: tl.constexpr):
    """PIVOTS keys inside (lo, hi) (int64, hi - lo > 1): half split the interval evenly in value (fast where it spans
    zero, whose keys are dense), half evenly in key (fast where it spans binades). [PIVOTS] int64"""
    j = tl.arange(0, PIVOTS)
    HALF: tl.constexpr = PIVOTS // 2
    share = (j % HALF + 1).to(tl.int64)  # 1 .. HALF in each half
    lo_v, hi_v = _value(lo.to(tl.int32)), _value((hi - 1).to(tl.int32))
    by_value = _key(lo_v + (hi_v - lo_v) * (share.to(tl.float32) / (HALF + 1))).to(tl.int64)
    by_key = lo + (hi - lo) * share // (HALF + 1)
    return tl.minimum(tl.maximum(tl.where(j < HALF, by_value, by_key), lo + 1), hi - 1)


@triton.jit
def _search(
    ptr,
    n,
    inv_t,
    top,
    lo,
    hi,
    target,
    MASS: tl.constexpr,
    LISTED: tl.constexpr,
    TILE: tl.constexpr,
    PIVOTS: tl.constexpr,
):
    """The largest key in [lo, hi) whose entries at or above reach target (lo when none above it does; at hi they do
    not). lo, hi int64 scalars."""
    while hi - lo > 1:
        pivots = _pivots(lo, hi, PIVOTS)
        reach = _at_or_above(ptr, n, inv_t, top, pivots.to(tl.int32), MASS, LISTED, TILE, PIVOTS) >= target
        lo = tl.maximum(lo, tl.max(tl.where(reach, pivots, lo), 0))
        hi = tl.minimum(hi, tl.min(tl.where(reach, hi, pivots), 0))
    return lo


@triton.jit
def _gather(row_ptr, vocab, inv_t, lo, hi, vals_ptr, ids_ptr, CAP, TILE: tl.constexpr, DEPTH: tl.constexpr):
    """Lists x / T and the token of every token with a key in [lo, hi), in token order (the first CAP of them).
    Returns how many there are."""
    count = tl.zeros([], tl.int32)
    for start in range(0, vocab, TILE * DEPTH):
        s, idx = _tile(row_ptr, start, vocab, inv_t, TILE, DEPTH)
        key = _key(s)
        take = (key >= lo) & (key < hi) & (idx < vocab)
        per_row = tl.sum(take.to(tl.int32), 1)
        found = tl.sum(per_row, 0)
        if found > 0:  # places in token order: the tile's rows one after another
            at = count + (tl.cumsum(per_row, 0) - per_row)[:, None] + tl.cumsum(take.to(tl.int32), 1) - 1
            tl.store(vals_ptr + at, s, mask=take & (at < CAP))
            tl.store(ids_ptr + at, idx, mask=take & (at < CAP))
            count += found
    tl.debug_barrier()  # the list is read by other threads of the program than wrote it
    return count


@triton.jit
def _collect(
    row_ptr, vocab, inv_t, lo, hi, vals_ptr, ids_ptr, count_ptr, CAP, TILE: tl.constexpr, DEPTH: tl.constexpr
):  # fmt: skip
    """As _gather, in no set order (places claimed with atomic adds on count_ptr, one int32 of the program's own):
    cheaper where the tokens are few and spread over the row (no scan per tile). Returns how many there are."""
    tl.store(count_ptr, 0)
    tl.debug_barrier()
    counter = count_ptr + tl.zeros([DEPTH, TILE], tl.int32)
    for start in range(0, vocab, TILE * DEPTH):
        s, idx = _tile(row_ptr, start, vocab, inv_t, TILE, DEPTH)
        key = _key(s)
        take = (key >= lo) & (key < hi) & (idx < vocab)
        at = tl.atomic_add(counter, 1, mask=take, sem="relaxed", scope="cta")
        tl.store(vals_ptr + at, s, mask=take & (at < CAP))
        tl.store(ids_ptr + at, idx, mask=take & (at < CAP))
    tl.debug_barrier()  # the list is read by other threads of the program than wrote it
    return tl.atomic_add(count_ptr, 0, sem="relaxed", scope="cta")


@triton.jit
def _kth_largest(values, k, TILE: tl.constexpr):
    """The key of the k-th largest of values [TILE] (1 <= k <= TILE, no NaN). int64 scalar"""
    kth = tl.sum(tl.where(tl.arange(0, TILE) == k - 1, tl.sort(values, descending=True), 0.0), 0)
    return _key(kth).to(tl.int64)


@triton.jit
def _sorted_list(vals_ptr, ids_ptr, count, LIST: tl.constexpr):
    """The first count (<= LIST) entries of a candidate list, the largest value first and of equal values the lowest
    token first; -inf and token 0 past count. ([LIST] float32, [LIST] int32)"""
    at = tl.arange(0, LIST)
    v = tl.load(vals_ptr + at, mask=at < count, other=float("-inf"))
    token = tl.load(ids_ptr + at, mask=at < count, other=0)
    # the key in the high half, the token reversed in the low half
    order = tl.sort((_key(v).to(tl.int64) << 32) | (0x7FFFFFFF - token).to(tl.int64), descending=True)
    return _value((order >> 32).to(tl.int32)), (0x7FFFFFFF - (order & 0xFFFFFFFF)).to(tl.int32)
