"""The whole sampler on the GPU in one launch: one program per batch row takes the argmax (greedy rows) or draws a
token after min-p, top-k and top-p, reading the logits in place, with no host sync.

Every pass over a row keeps per lane (tokens lane, lane + BLOCK, lane + 2 BLOCK, ...) running values, reduced once
at the end (pagedllm/kernels/row_passes.py: the passes it shares with the logprobs kernel).

The draw is by inverse CDF over the lanes: one pass keeps each lane's max and sum of exp(x / T - max) over the tokens
the row keeps (online, as a softmax), then the lane where a uniform share of the total falls is picked from the
lanes' running sums, and the token inside it from the running sum of its own few tokens. One uniform number per draw
(Philox, keyed by the row's 64-bit key: a seeded request keys by (seed, position), so it gets the same token whatever
shares its batch; the others by the step's key plus the row).

Filters. min-p keeps x / T >= max(x / T) + log(min_p): a threshold after a pass for the max. top-p is drawn by
rejection: a draw is kept when the tokens more likely than it weigh less than top_p of the kept mass (the sorted
cumsum rule of HF's TopPLogitsWarper); otherwise the row is drawn again among the tokens more likely than the
rejected one. Every round draws from a set that holds the whole nucleus, so the kept draw follows the renormalized
nucleus exactly, and the first round is kept with probability >= top_p. The pass that weighs the tokens above a draw
is also the next round's weighing pass: a round costs one pass over the row (in L2).

top-k keeps the tokens at or above the k-th largest value (ties all kept, as HF's TopKLogitsWarper). At least k
tokens reach the k-th largest lane maximum, so a pass lists the tokens at or above it (a few more than k) with their
x / T. A list of up to SMALL entries is sorted in registers: the k-th entry, then top-p's cut (the first entry
whose running mass reaches top_p of what top-k keeps) are read off it, and the token drawn by inverse CDF over it.
On a longer list (many equal values) the k-th largest value and then top-p's cut are found by a multi-way search
over float32 values (as order-preserving int32 keys: each pass counts the entries, or sums their mass, at PIVOTS
points of the remaining interval at once), and the token is drawn from the list by the exponential race (Gumbel-max:
argmax_i x_i / T - log E_i with E_i ~ Exp(1) from Philox, counted by token). Where the list would be too long to
store (or k is beyond the lanes), the k-th largest value is searched over the row itself and top-p drawn by
rejection over the row.

As the torch path: NaN logits are never drawn (nor taken by the argmax), +inf counts as the largest float (it wins),
a row with every token at -inf takes token 0. Exact up to float32 rounding of the sums and of the uniform (2**-24 of
the mass). The draws depend on BLOCK (it lays out the lanes)."""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from pagedllm.kernels.row_passes import (
    _LOG2E,
    _at_or_above,
    _gather,
    _key,
    _kth_largest,
    _lane_max,
    _search,
    _sorted_list,
    _tile,
    _tokens,
)

_GREEDY_BELOW = tl.constexpr(1e-5)  # a temperature below this takes the argmax (as SamplingMetadata)
_BLOCK = 1024  # lanes of a pass over a row
_DEPTH = 2  # blocks of tokens per iteration of a pass (more loads in flight)
_PIVOTS = 16  # points per threshold-search pass
_SMALL = 256  # entries per tile of a candidate list
_CAP = 8192  # candidates listed per top-k row: more, and the row itself is searched
_ROUND = tl.constexpr(1 << 30)  # the Philox counter of a draw's uniform, plus the round (counters by token stay below)


@triton.jit
def _log_exp1(bits):
    """log E for E ~ Exp(1) from uint32 random bits: E = -log(1 - u), u = (bits + 1/2) / 2**32 in (0, 1)."""
    u = tl.minimum((bits.to(tl.float32) + 0.5) * 2.3283064365386963e-10, 0.99999994)
    series = u * (1.0 + u * (0.5 + u * (0.33333334 + u * 0.25)))  # -log(1 - u), relative error < 2e-7 below 2**-5
    return tl.log(tl.where(u < 0.03125, series, -tl.log(1.0 - u)))


@triton.jit
def _argmax(row_ptr, vocab, TILE: tl.constexpr, DEPTH: tl.constexpr):
    """The first largest logit's token (NaN never; a row of -inf: token 0). int32 scalar"""
    best = tl.full([TILE], float("-inf"), tl.float32)
    best_idx = tl.zeros([TILE], tl.int32)
    for start in range(0, vocab, TILE * DEPTH):
        s, idx = _tile(row_ptr, start, vocab, 1.0, TILE, DEPTH)
        tile_best = tl.max(s, 0)
        first = tl.min(tl.where(s == tile_best[None, :], idx, 2147483647), 0)  # the lane's first at its max
        better = tile_best > best  # strict: the first of equal values stays (a row of -inf keeps token 0)
        best, best_idx = tl.where(better, tile_best, best), tl.where(better, first, best_idx)
    return tl.min(tl.where(best == tl.max(best, 0), best_idx, vocab), 0)


@triton.jit
def _hash32(x):
    """A 32-bit integer mix (int64 holding a value < 2**32; every product stays below 2**63)."""
    mask = tl.full([], 0xFFFFFFFF, tl.int64)
    x = ((x >> 16) ^ x) * 0x45D9F3B & mask
    x = ((x >> 16) ^ x) * 0x45D9F3B & mask
    return (x >> 16) ^ x


@triton.jit
def _seeded_key(low, high, position):
    """The 63-bit Philox key of a seeded row from its seed's two 32-bit words and its position (int32 each):
    the same whatever else is in the batch."""
    mask = tl.full([], 0xFFFFFFFF, tl.int64)
    lo, hi, pos = low.to(tl.int64) & mask, high.to(tl.int64) & mask, position.to(tl.int64) & mask
    seed = _hash32(lo ^ _hash32(hi + 0x9E3779B9))
    top = _hash32(seed ^ _hash32(pos + 0x2545F491)) & 0x7FFFFFFF
    return (top << 32) | _hash32(seed ^ _hash32(pos + 0x7F4A7C15))


@triton.jit
def _weigh(row_ptr, vocab, inv_t, floor, TILE: tl.constexpr, DEPTH: tl.constexpr):
    """Per lane: the max m of x / T over its tokens with a key >= floor (int32) and the sum z of exp(x / T - m) over
    them (m = -inf and z = 0 where none), as an online softmax. ([TILE], [TILE])"""
    m = tl.full([TILE], float("-inf"), tl.float32)
    z = tl.zeros([TILE], tl.float32)
    for start in range(0, vocab, TILE * DEPTH):
        s = _tile(row_ptr, start, vocab, inv_t, TILE, DEPTH)[0]
        s = tl.where(_key(s) >= floor, s, float("-inf"))
        new_m = tl.maximum(m, tl.max(s, 0))
        safe = tl.where(new_m == float("-inf"), 0.0, new_m)  # no -inf - -inf
        z = z * tl.exp2((m - safe) * _LOG2E) + tl.sum(tl.exp2((s - safe[None, :]) * _LOG2E), 0)
        m = new_m
    return m, z


@triton.jit
def _lane_mass(m, z, top):
    """Each lane's sum in units of exp(x / T - top) (top >= every m, finite). [TILE]"""
    return tl.where(m == float("-inf"), 0.0, z * tl.exp2((m - top) * _LOG2E))


@triton.jit
def _draw(row_ptr, vocab, inv_t, floor, m, z, top, u, TILE: tl.constexpr, PER_LANE: tl.constexpr):
    """The inverse-CDF draw of a token with a key >= floor (int32) from the lanes' (m, z) of _weigh (top: max m, finite;
    u in [0, 1)): the lane where u of the total mass falls, then the token within the lane. Where rounding puts u past
    a sum, the last lane or token of some mass is taken. int32 scalar"""
    lanes = tl.arange(0, TILE)
    w = _lane_mass(m, z, top)
    cum = tl.cumsum(w, 0)
    target = u * tl.max(cum, 0)
    lane = tl.min(tl.where(cum > target, lanes, TILE), 0)
    lane = tl.minimum(lane, tl.max(tl.where(w > 0, lanes, 0), 0))
    rest = target - tl.sum(tl.where(lanes == lane, cum - w, 0.0), 0)  # the share left for the lane's tokens
    i = tl.arange(0, PER_LANE)
    s = _tokens(row_ptr, lane + i * TILE, vocab, inv_t)
    s = tl.where(_key(s) >= floor, s, float("-inf"))
    ws = tl.exp2((s - top) * _LOG2E)
    at = tl.min(tl.where(tl.cumsum(ws, 0) > rest, i, PER_LANE), 0)
    at = tl.minimum(at, tl.max(tl.where(ws > 0, i, 0), 0))
    return lane + at * TILE


@triton.jit
def _uniform(key, draw):
    """A float32 in [0, 1) from Philox, one per (key, draw)."""
    u = tl.rand(key, tl.full([1], _ROUND, tl.int32) + draw)
    return tl.minimum(tl.sum(u, 0), 0.99999994)


@triton.jit
def _draw_by_rejection(
    row_ptr, vocab, inv_t, floor, top_p, key, TILE: tl.constexpr, DEPTH: tl.constexpr, PER_LANE: tl.constexpr
):
    """A token with a key >= floor (int32) drawn from softmax(x / T) over them, after top-p by rejection (top_p 1: the
    first draw); token 0 where every token is out."""
    m, z = _weigh(row_ptr, vocab, inv_t, floor, TILE, DEPTH)
    top = tl.max(m, 0)
    token = tl.zeros([], tl.int32)
    if top > float("-inf"):
        kept = tl.sum(_lane_mass(m, z, top), 0)
        token = _draw(row_ptr, vocab, inv_t, floor, m, z, top, _uniform(key, 0), TILE, PER_LANE)
        rounds = 1
        outside = top_p < 1.0  # whether the draw may lie outside the nucleus
        while outside:
            above = _key(_tokens(row_ptr, token, vocab, inv_t)) + 1  # the tokens more likely than the draw
            m, z = _weigh(row_ptr, vocab, inv_t, above, TILE, DEPTH)
            outside = tl.sum(_lane_mass(m, z, top), 0) >= top_p * kept
            if outside:  # the nucleus lies among the tokens above the draw: draw there
                token = _draw(row_ptr, vocab, inv_t, above, m, z, top, _uniform(key, rounds), TILE, PER_LANE)
                rounds += 1
    return token


@triton.jit
def _top_k(
    row_ptr, vocab, inv_t, top, lane_top, floor, top_k, top_p, vals_ptr, ids_ptr, cap, TILE: tl.constexpr,
    DEPTH: tl.constexpr, SMALL: tl.constexpr, PIVOTS: tl.constexpr,
):  # fmt: skip
    """top-k of the tokens with a key >= floor (min-p's), then top-p over what it keeps when the candidates are
    listed. Returns the key of the last kept token and how many candidates the list holds (-1 when it does not hold
    every kept token: top-p is then left to the draw over the row).

    The candidates are the tokens at or above the k-th largest lane maximum (for k <= TILE; at least k tokens
    reach it)."""
    hi = _key(top).to(tl.int64) + 1
    lo = floor
    if top_k <= TILE:
        lo = tl.maximum(lo, _kth_largest(lane_top, top_k, TILE))
    count = cap + 1
    if tl.sum((_key(lane_top) >= lo).to(tl.int32), 0) <= TILE // 2:  # else far too many to list: do not try
        count = _gather(row_ptr, vocab, inv_t, lo, hi, vals_ptr, ids_ptr, cap, TILE, DEPTH)
    if count <= tl.minimum(cap, SMALL):  # few enough to sort: _draw_sorted cuts them
        floor = lo
    elif count <= cap:  # search the list
        floor = _search(vals_ptr, count, 1.0, top, lo, hi, top_k, False, True, SMALL, PIVOTS)
        if top_p < 1:
            at_floor = tl.full([1], 0, tl.int32) + floor.to(tl.int32)
            kept = tl.max(_at_or_above(vals_ptr, count, 1.0, top, at_floor, True, True, SMALL, 1), 0)
            floor = _search(vals_ptr, count, 1.0, top, floor, hi, top_p * kept, True, True, SMALL, PIVOTS)
    else:  # search the row
        floor = _search(row_ptr, vocab, inv_t, top, lo, hi, top_k, False, False, SMALL, PIVOTS)
        count = -1
    return floor, count


@triton.jit
def _draw_sorted(vals_ptr, ids_ptr, count, top, top_k, top_p, u, LIST: tl.constexpr):
    """The inverse-CDF draw (u in [0, 1)) from a candidate list of count <= LIST entries that holds every token the
    row keeps (top: the row's max x / T), sorted: top-k keeps the entries at or above the k-th (ties all kept), top-p
    those at or above the first whose running mass reaches top_p of what top-k keeps. int32 scalar"""
    v, token = _sorted_list(vals_ptr, ids_ptr, count, LIST)
    at = tl.arange(0, LIST)
    key = _key(v)
    kth = tl.sum(tl.where(at == tl.minimum(top_k, count) - 1, key, 0), 0)  # fewer than k listed: every one
    w = tl.where((key >= kth) & (at < count), tl.exp2((v - top) * _LOG2E), 0.0)
    if top_p < 1:
        cum = tl.cumsum(w, 0)
        last = tl.minimum(tl.min(tl.where(cum >= top_p * tl.sum(w, 0), at, LIST), 0), count - 1)
        w = tl.where(key >= tl.sum(tl.where(at == last, key, 0), 0), w, 0.0)
    cum = tl.cumsum(w, 0)
    pick = tl.min(tl.where(cum > u * tl.max(cum, 0), at, LIST), 0)
    pick = tl.minimum(pick, tl.max(tl.where(w > 0, at, 0), 0))  # rounding past the total: the last of some mass
    return tl.sum(tl.where(at == pick, token, 0), 0)


@triton.jit
def _race_listed(vals_ptr, ids_ptr, n, key, floor, TILE: tl.constexpr):
    """The exponential race over a candidate list (entries with a key below floor are out), one Philox number per
    token counted by its id. Returns the winner (of equal scores the lowest token; an empty list: 0)."""
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
    return tl.min(tl.where(best == tl.max(best, 0), best_idx, 2147483647), 0)


@triton.jit(do_not_specialize=["step_key"])
def sample_kernel(
    logits_ptr,  # [batch, vocab] float32 / bfloat16 / float16, unit stride along the vocabulary
    params_ptr,  # [batch, 8] 32-bit words, unit column stride (pack_params): float32 temperature (below
    # _GREEDY_BELOW: argmax), top_k (0 = off), top_p, min_p; then the seed's low and high words, the position and
    # whether the row is seeded (int32 bits)
    out_ptr,  # [batch] int64
    vals_ptr,  # [batch, cap] float32 scratch: each top-k row's candidates (x / T)
    ids_ptr,  # [batch, cap] int32 scratch: their tokens
    vocab,
    stride_row,
    stride_params,
    cap,
    step_key,  # int64: the key of unseeded rows is step_key + row
    BLOCK: tl.constexpr,
    DEPTH: tl.constexpr,  # a pass reads DEPTH x BLOCK tokens per iteration (the same lanes; more loads in flight)
    PER_LANE: tl.constexpr,  # a power of 2 >= the tokens per lane (vocab / BLOCK)
    SMALL: tl.constexpr,  # entries per tile of a top-k row's candidate list (and of its search over the row)
    PIVOTS: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    params_ptr += row * stride_params
    temperature = tl.load(params_ptr)
    if temperature < _GREEDY_BELOW:
        token = _argmax(row_ptr, vocab, BLOCK, DEPTH)
    else:
        inv_t = 1.0 / temperature
        top_k = tl.load(params_ptr + 1).to(tl.int32)
        top_p = tl.load(params_ptr + 2)
        min_p = tl.load(params_ptr + 3)
        words = (params_ptr + 4).to(tl.pointer_type(tl.int32))
        key = step_key.to(tl.int64) + row
        if tl.load(words + 3) != 0:  # seeded: the key of (seed, position)
            key = _seeded_key(tl.load(words), tl.load(words + 1), tl.load(words + 2))
        floor = tl.full([], -2147483648, tl.int64)  # the smallest key: every token is in
        listed = tl.full([], -1, tl.int32)  # how many candidates the list holds (-1: none listed)
        top = tl.zeros([], tl.float32)  # the row's max x / T, where listed
        if (min_p > 0) | (top_k > 0):
            lane_top = _lane_max(row_ptr, vocab, inv_t, BLOCK, DEPTH)
            top = tl.max(lane_top, 0)
            if top > float("-inf"):  # else every token is banned: token 0
                floor = _key(top + tl.log(min_p)).to(tl.int64)  # min_p 0: the key of -inf
                if top_k > 0:
                    floor, listed = _top_k(
                        row_ptr, vocab, inv_t, top, lane_top, floor, top_k, top_p, vals_ptr + row * cap,
                        ids_ptr + row * cap, cap, BLOCK, DEPTH, SMALL, PIVOTS,
                    )  # fmt: skip
        if listed > SMALL:
            token = _race_listed(vals_ptr + row * cap, ids_ptr + row * cap, listed, key, floor.to(tl.int32), SMALL)
        elif listed >= 0:
            token = _draw_sorted(
                vals_ptr + row * cap, ids_ptr + row * cap, listed, top, top_k, top_p, _uniform(key, 0), SMALL
            )  # fmt: skip
        else:
            token = _draw_by_rejection(
                row_ptr, vocab, inv_t, floor.to(tl.int32), top_p, key, BLOCK, DEPTH, PER_LANE
            )  # fmt: skip
    tl.store(out_ptr + row, token.to(tl.int64))


def pack_params(
    temperature: np.ndarray,  # [batch] float32
    top_k: np.ndarray,  # [batch] int64, 0 = off
    top_p: np.ndarray,  # [batch] float32, 1 = off
    min_p: np.ndarray,  # [batch] float32, 0 = off
    seeds: np.ndarray | None = None,  # [batch] int64
    seeded: np.ndarray | None = None,  # [batch] bool
    positions: np.ndarray | None = None,  # [batch] int64: the draw's counter of a seeded row
) -> np.ndarray:
    """The kernel's parameters of every row, one row of 8 32-bit words each. [batch, 8] float32"""
    packed = np.zeros((len(temperature), 8), dtype=np.float32)
    packed[:, 0], packed[:, 1], packed[:, 2], packed[:, 3] = temperature, top_k, top_p, min_p
    if seeded is not None and seeded.any():
        words = packed.view(np.int32)
        words[:, 4:6] = seeds.astype(np.int64).reshape(-1, 1).view(np.int32)  # low word, high word
        words[:, 6] = positions
        words[:, 7] = seeded
    return packed


def sample(
    logits: torch.Tensor,  # [batch, vocab]
    params: torch.Tensor,  # [batch, 8] float32, unit column stride: pack_params
    step_key: int,  # in [0, 2**62): the unseeded rows' keys are step_key + row
    block: int = _BLOCK,
    cap: int = _CAP,
) -> torch.Tensor:
    """One token per row of logits: the argmax, or a draw from softmax(x / T) after min-p, top-k and top-p. Launches
    one kernel and never waits for the device. block: lanes per pass (a power of 2; the draws depend on it)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    if logits.shape[0]:
        vocab = logits.shape[1]
        cap = min(cap, vocab)
        vals = torch.empty(logits.shape[0], cap, dtype=torch.float32, device=logits.device)
        ids = torch.empty(logits.shape[0], cap, dtype=torch.int32, device=logits.device)
        sample_kernel[(logits.shape[0],)](
            logits,
            params,
            out,
            vals,
            ids,
            vocab,
            logits.stride(0),
            params.stride(0),
            cap,
            step_key,
            BLOCK=block,
            DEPTH=_DEPTH,
            PER_LANE=triton.next_power_of_2(triton.cdiv(vocab, block)),
            SMALL=min(block, _SMALL),
            PIVOTS=_PIVOTS,
            num_warps=8 if block >= 1024 else 4,
        )
    return out
