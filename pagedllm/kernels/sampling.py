"""The whole sampler on the GPU in one launch: one program per batch row takes the argmax (greedy rows) or draws a
token after min-p, top-k and top-p, reading the logits in place, with no host sync.

Filters as thresholds. min-p keeps x / T >= max(x / T) + log(min_p). top-k and top-p each keep the tokens at or
above a threshold value: top-k the k-th largest (ties all kept, as HF's TopKLogitsWarper), top-p the largest value
whose tokens from the top down reach top_p of the mass that min-p and top-k left (a token stays when the mass of the
more likely ones is below it: the sorted cumsum rule of HF's TopPLogitsWarper). Each threshold is found without a
sort by a multi-way search over float32 values (as order-preserving int32 keys): a pass over the row counts the
tokens (top-k) or sums their mass (top-p) at PIVOTS points of the remaining interval at once, which narrows it
PIVOTS + 1 times; about 8 passes pin a 32-bit key. The row stays in L2 between passes.

The draw is the exponential race: with p_i = softmax(x / T)_i over the kept tokens and independent E_i ~ Exp(1),
argmax_i p_i / E_i is a draw from p exactly (P(i wins) = p_i / sum_j p_j). In log space that is argmax_i (x_i / T -
log E_i) (the Gumbel-max trick): one pass, a running (best score, best index) per lane, then a reduction over lanes.
E_i = -log(1 - u_i) with u_i from Triton's Philox, keyed by the row's 64-bit key and counted by token, so a row's
draw depends only on its logits, parameters and key (a seeded request keys by (seed, position): the same token
whatever shares its batch; the others by the step's key plus the row). The race is won by small E (the winner's E
is about p_i / sum p), so E is made precise there: u = bits / 2**32 keeps full float precision near 0 and
-log(1 - u) is a series for u < 2**-5.

As the torch path: NaN logits are never drawn (nor taken by the argmax), +inf counts as the largest float (it wins),
a row with every token at -inf takes token 0. Exact up to float32 rounding of x / T - log E and of the masses: where
|x / T| is so large (beyond ~1e6) that the noise is lost in it, equal scores go to the lowest token (several +inf
logits: the first), where the torch path draws among them uniformly. The draws depend on BLOCK (it lays out the
Philox counters)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_FLOAT_MAX = tl.constexpr(3.4028234663852886e38)  # +inf logits become this
_LOG2E = tl.constexpr(1.4426950408889634)
_GREEDY_BELOW = tl.constexpr(1e-5)  # a temperature below this takes the argmax (as SamplingMetadata)
_BLOCK = 2048  # tokens per race iteration: 4 streams of _BLOCK // 4 Philox counters; the other passes use _BLOCK // 4
_PIVOTS = 16  # points per threshold-search pass
_CAP = 8192  # candidates listed per filtered row: more, and the row itself is searched


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
def _key(s):
    """An int32 that orders as the float32 s does (s not NaN)."""
    bits = s.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _log_exp1(bits):
    """log E for E ~ Exp(1) from uint32 random bits: E = -log(1 - u), u = (bits + 1/2) / 2**32 in (0, 1)."""
    u = tl.minimum((bits.to(tl.float32) + 0.5) * 2.3283064365386963e-10, 0.99999994)
    series = u * (1.0 + u * (0.5 + u * (0.33333334 + u * 0.25)))  # -log(1 - u), relative error < 2e-7 below 2**-5
    return tl.log(tl.where(u < 0.03125, series, -tl.log(1.0 - u)))


@triton.jit
def _value(key):
    """The float32 of an int32 key (the inverse of _key)."""
    return tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _lane_max(row_ptr, vocab, inv_t, TILE: tl.constexpr):
    """The largest x / T of each lane (tokens lane, lane + TILE, ...). [TILE]"""
    top = tl.full([TILE], float("-inf"), tl.float32)
    for start in range(0, vocab, TILE):
        top = tl.maximum(top, _tokens(row_ptr, start + tl.arange(0, TILE), vocab, inv_t))
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
def _gather(row_ptr, vocab, inv_t, top, lo, hi, floor, vals_ptr, ids_ptr, CAP, WEIGH: tl.constexpr, TILE: tl.constexpr):
    """Lists x / T and the token of every token with a key in [lo, hi), in token order (the first CAP of them), and
    (WEIGH) sums the weights exp(x / T - top) of the tokens with a key >= floor. Returns (how many there are, the
    sum)."""
    count = tl.zeros([], tl.int32)
    mass = tl.zeros([TILE], tl.float32)
    for start in range(0, vocab, TILE):
        idx = start + tl.arange(0, TILE)
        s = _tokens(row_ptr, idx, vocab, inv_t)
        key = _key(s)
        if WEIGH:
            mass += tl.where(key >= floor, tl.exp2((s - top) * _LOG2E), 0.0)
        take = (key >= lo) & (key < hi) & (idx < vocab)
        found = tl.sum(take.to(tl.int32), 0)
        if found > 0:
            at = count + tl.cumsum(take.to(tl.int32), 0) - 1
            tl.store(vals_ptr + at, s, mask=take & (at < CAP))
            tl.store(ids_ptr + at, idx, mask=take & (at < CAP))
            count += found
    tl.debug_barrier()  # the list is read by other threads of the program than wrote it
    return count, tl.sum(mass, 0)


@triton.jit
def _narrow(row_ptr, vocab, inv_t, top, lo, hi, above, anchor, top_p, TILE: tl.constexpr, PIVOTS: tl.constexpr):
    """One pass of the top-p search over the row that also weighs the kept set (the tokens at or above anchor) and
    counts the tokens at each pivot. above: the mass at or above hi. Returns the narrowed (lo, hi), how many tokens
    lie in it (or more), the mass at or above the new hi, and the nucleus's target mass (top_p times the kept)."""
    j = tl.arange(0, PIVOTS)
    pivots = tl.where(j == 0, anchor, _pivots(lo, hi, PIVOTS))  # slot 0 weighs the kept set
    at = pivots.to(tl.int32)[:, None]
    mass = tl.zeros([PIVOTS, TILE], tl.float32)
    count = tl.zeros([PIVOTS, TILE], tl.int32)
    for start in range(0, vocab, TILE):
        s = _tokens(row_ptr, start + tl.arange(0, TILE), vocab, inv_t)
        hit = _key(s)[None, :] >= at
        mass += tl.where(hit, tl.exp2((s - top) * _LOG2E)[None, :], 0.0)
        count += hit.to(tl.int32)
    mass, count = tl.sum(mass, axis=1), tl.sum(count, axis=1)
    target = top_p * tl.sum(tl.where(j == 0, mass, 0.0), 0)
    probe = (j > 0) & (hi - lo > 1)
    reach = probe & (mass >= target)
    short = probe & (mass < target)
    new_lo = tl.maximum(lo, tl.max(tl.where(reach, pivots, lo), 0))
    new_hi = tl.minimum(hi, tl.min(tl.where(short, pivots, hi), 0))
    at_hi = short & (pivots == new_hi)  # none where hi stays
    moved = tl.max(at_hi.to(tl.int32), 0) > 0
    above = tl.where(moved, tl.max(tl.where(at_hi, mass, 0.0), 0), above)
    # tokens in [new_lo, new_hi): those at or above new_lo less those at or above new_hi, each counted at a pivot
    # (where lo or hi stays: every token, and none)
    inside_count = tl.min(tl.where(reach & (pivots == new_lo), count, vocab), 0) - tl.max(tl.where(at_hi, count, 0), 0)
    return new_lo, new_hi, inside_count, above, target


@triton.jit
def _race(best, best_idx, row_ptr, idx, bits, inv_t, floor, vocab):
    """One quarter tile: the running best (score, token) per lane, updated with tokens idx [QUARTER]; tokens with a
    key below floor are out."""
    s = _tokens(row_ptr, idx, vocab, inv_t)
    s = tl.where(_key(s) >= floor, s, float("-inf"))
    score = s - _log_exp1(bits)  # -inf stays -inf: dropped tokens never win
    better = score > best  # strict: the first of equal scores stays (a row of -inf keeps token 0)
    return tl.where(better, score, best), tl.where(better, idx, best_idx)


@triton.jit
def _filter(
    row_ptr, vocab, inv_t, top, lane_top, floor, top_k, top_p, vals_ptr, ids_ptr, cap, TILE: tl.constexpr,
    PIVOTS: tl.constexpr,
):  # fmt: skip
    """top-k, then top-p over what it keeps, of the tokens with a key >= floor (min-p's). Returns the key of the last
    kept token and how many candidates the list holds (-1 when it does not hold every kept token: the race is then
    run over the row).

    The candidates are the tokens at or above a bound the threshold cannot fall below: for top-k (k <= TILE) the
    k-th largest lane maximum (at least k tokens reach it); for top-p top + log((1 - top_p) / vocab) - 1 (the tokens
    below it weigh less than (1 - top_p) times the kept mass, which is >= 1, the top token's weight)."""
    hi = _key(top).to(tl.int64) + 1
    lo = floor
    if top_k > 0:
        if top_k <= TILE:
            kth = tl.sum(tl.where(tl.arange(0, TILE) == top_k - 1, tl.sort(lane_top, descending=True), 0.0), 0)
            lo = tl.maximum(lo, _key(kth).to(tl.int64))
    else:
        lo = tl.maximum(lo, _key(top + tl.log((1.0 - top_p) / vocab) - 1.0).to(tl.int64))
    count = cap + 1
    kept = 0.0
    if tl.sum((_key(lane_top) >= lo).to(tl.int32), 0) <= TILE // 2:  # else far too many to list: do not try
        count, kept = _gather(row_ptr, vocab, inv_t, top, lo, hi, floor, vals_ptr, ids_ptr, cap, True, TILE)
    if count <= cap:  # search the list
        if top_k > 0:
            floor = _search(vals_ptr, count, 1.0, top, lo, hi, top_k, False, True, TILE, PIVOTS)
            at_floor = tl.full([1], 0, tl.int32) + floor.to(tl.int32)
            kept = tl.max(_at_or_above(vals_ptr, count, 1.0, top, at_floor, True, True, TILE, 1), 0)
        if top_p < 1:
            lo = tl.maximum(floor, lo)
            floor = _search(vals_ptr, count, 1.0, top, lo, hi, top_p * kept, True, True, TILE, PIVOTS)
    else:  # search the row, or list what one pass over it narrows the top-p search to
        if top_k > 0:
            floor = _search(row_ptr, vocab, inv_t, top, lo, hi, top_k, False, False, TILE, PIVOTS)
        if top_p < 1:
            lo = tl.maximum(floor, lo)
            above = tl.zeros([], tl.float32)  # nothing is at or above hi = key(top) + 1
            target = tl.zeros([], tl.float32)
            inside = cap + 1
            rounds = 0
            while (inside > cap) & (rounds < 4):  # each pass narrows the nucleus's cut PIVOTS // 2 + 1 times or more
                lo, hi, inside, above, target = _narrow(
                    row_ptr, vocab, inv_t, top, lo, hi, above, floor, top_p, TILE, PIVOTS
                )  # fmt: skip
                rounds += 1
            if inside <= cap:  # list them; the list lacks the tokens at or above hi: their mass is off the target
                count, _ = _gather(row_ptr, vocab, inv_t, top, lo, hi, floor, vals_ptr, ids_ptr, cap, False, TILE)
                floor = _search(vals_ptr, count, 1.0, top, lo, hi, target - above, True, True, TILE, PIVOTS)
            else:
                floor = _search(row_ptr, vocab, inv_t, top, lo, hi, target, True, False, TILE, PIVOTS)
        count = -1
    return floor, count


@triton.jit
def _race_listed(vals_ptr, ids_ptr, n, key, floor, TILE: tl.constexpr):
    """The exponential race over a candidate list (entries with a key below floor are out), one Philox number per
    token counted by its id. Returns the per-lane best (score, token)."""
    best = tl.full([TILE], float("-inf"), tl.float32)
    best_idx = tl.zeros([TILE], tl.int32)
    for start in range(0, n, TILE):
        at = start + tl.arange(0, TILE)
        s = tl.load(vals_ptr + at, mask=at < n, other=float("-inf"))
        token = tl.load(ids_ptr + at, mask=at < n, other=0)
        s = tl.where(_key(s) >= floor, s, float("-inf"))
        score = s - _log_exp1(tl.randint(key, token))
        better = score > best  # the list is in token order: the first of equal scores is the lowest token
        best, best_idx = tl.where(better, score, best), tl.where(better, token, best_idx)
    return best, best_idx


@triton.jit(do_not_specialize=["step_key"])
def sample_kernel(
    logits_ptr,  # [batch, vocab] float32 / bfloat16 / float16, unit stride along the vocabulary
    params_ptr,  # [batch, 4] float32, unit column stride: temperature (below _GREEDY_BELOW: argmax), top_k (0 = off),
    # top_p, min_p
    seed_keys_ptr,  # [batch] int64: the Philox key of a seeded row, -1 for the others
    out_ptr,  # [batch] int64
    vals_ptr,  # [batch, cap] float32 scratch: each filtered row's candidates (x / T)
    ids_ptr,  # [batch, cap] int32 scratch: their tokens
    vocab,
    stride_row,
    stride_params,
    stride_keys,
    cap,
    step_key,  # int64: the key of unseeded rows is step_key + row
    BLOCK: tl.constexpr,
    PIVOTS: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    QUARTER: tl.constexpr = BLOCK // 4
    lanes = tl.arange(0, QUARTER)
    params_ptr += row * stride_params
    temperature = tl.load(params_ptr)
    best = tl.full([QUARTER], float("-inf"), tl.float32)
    best_idx = tl.zeros([QUARTER], tl.int32)
    if temperature < _GREEDY_BELOW:  # the first largest logit
        for start in range(0, vocab, QUARTER):
            idx = start + lanes
            s = _tokens(row_ptr, idx, vocab, 1.0)
            better = s > best
            best, best_idx = tl.where(better, s, best), tl.where(better, idx, best_idx)
    else:
        inv_t = 1.0 / temperature
        top_k = tl.load(params_ptr + 1)
        top_p = tl.load(params_ptr + 2)
        min_p = tl.load(params_ptr + 3)
        key = tl.load(seed_keys_ptr + row * stride_keys)
        key = tl.where(key >= 0, key, step_key + row)
        floor = tl.full([], -2147483648, tl.int64)  # the smallest key: every token is in
        listed = tl.full([], -1, tl.int32)  # how many candidates the list holds (-1: none listed)
        if (min_p > 0) | (top_k > 0) | (top_p < 1):
            lane_top = _lane_max(row_ptr, vocab, inv_t, QUARTER)
            top = tl.max(lane_top, 0)
            if top > float("-inf"):  # else every token is banned: token 0
                floor = _key(top + tl.log(min_p)).to(tl.int64)  # min_p 0: the key of -inf
                if (top_k > 0) | (top_p < 1):
                    floor, listed = _filter(
                        row_ptr, vocab, inv_t, top, lane_top, floor, top_k, top_p, vals_ptr + row * cap,
                        ids_ptr + row * cap, cap, QUARTER, PIVOTS,
                    )  # fmt: skip
        if listed >= 0:
            vals, ids = vals_ptr + row * cap, ids_ptr + row * cap
            best, best_idx = _race_listed(vals, ids, listed, key, floor.to(tl.int32), QUARTER)
        else:
            cut = floor.to(tl.int32)
            for start in range(0, vocab, BLOCK):
                b0, b1, b2, b3 = tl.randint4x(key, start // 4 + lanes)  # counters unique per (row, tile, lane)
                idx = start + lanes
                best, best_idx = _race(best, best_idx, row_ptr, idx, b0, inv_t, cut, vocab)
                best, best_idx = _race(best, best_idx, row_ptr, idx + QUARTER, b1, inv_t, cut, vocab)
                best, best_idx = _race(best, best_idx, row_ptr, idx + 2 * QUARTER, b2, inv_t, cut, vocab)
                best, best_idx = _race(best, best_idx, row_ptr, idx + 3 * QUARTER, b3, inv_t, cut, vocab)
    top_score = tl.max(best, 0)
    token = tl.min(tl.where(best == top_score, best_idx, vocab), 0)  # the first of the best (all -inf: token 0)
    tl.store(out_ptr + row, token.to(tl.int64))


def sample(
    logits: torch.Tensor,  # [batch, vocab]
    params: torch.Tensor,  # [batch, 4] float32, unit column stride: temperature, top_k, top_p, min_p
    seed_keys: torch.Tensor,  # [batch] int64: a seeded row's key, -1 for the others
    step_key: int,  # in [0, 2**62): the unseeded rows' keys are step_key + row
    out: torch.Tensor | None = None,  # [batch] int64
    block: int = _BLOCK,
    pivots: int = _PIVOTS,
    cap: int = _CAP,
) -> torch.Tensor:
    """One token per row of logits: the argmax, or a draw from softmax(x / T) after min-p, top-k and top-p. Launches
    one kernel and never waits for the device. block: tokens per race iteration (a power of 2 >= 4; the draws depend
    on it); pivots: a power of 2."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if out is None:
        out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    if logits.shape[0]:
        cap = min(cap, logits.shape[1])
        vals = torch.empty(logits.shape[0], cap, dtype=torch.float32, device=logits.device)
        ids = torch.empty(logits.shape[0], cap, dtype=torch.int32, device=logits.device)
        sample_kernel[(logits.shape[0],)](
            logits,
            params,
            seed_keys,
            out,
            vals,
            ids,
            logits.shape[1],
            logits.stride(0),
            params.stride(0),
            seed_keys.stride(0),
            cap,
            step_key,
            BLOCK=block,
            PIVOTS=pivots,
            num_warps=16 if block >= 2048 else 4,
        )
    return out
