"""The whole sampler on the GPU in one launch: one program per batch row takes the argmax (greedy rows) or draws a token
after min-p, top-k and top-p, reading the logits in place, with no host sync. A penalized row's program first applies
the penalties to its row (pagedllm/kernels/penalties.py): in place, the logits it changes put back once it has sampled;
or, where the row wants logprobs (which read the logits as they are), in a copy of the row. A row that wants logprobs
gets one more program, which reads the logits as they are for the log-sum-exp and the top tokens
(pagedllm/kernels/logprobs.py), while the row's own program adds the sampled token's rank and logit. The inputs are two
int32 arrays (laid out by pagedllm/kernels/sampling_inputs.py): a state per row of the persistent batch (parameters,
penalized tokens), which the kernel advances as it samples, and the step's rows; a step whose batch goes on as it was
uploads neither and costs one launch. The programs of the rows that want logprobs come first, then the rows' own, the
likely slowest first (program_order): programs start in order, and a big batch's do not all fit on the device at once.

Every pass over a row keeps per lane (tokens lane, lane + BLOCK, lane + 2 BLOCK, ...) running values, reduced once
at the end (pagedllm/kernels/row_passes.py: the passes it shares with the logprobs kernel).

A row without filters (min-p, top-k, top-p) is drawn by the exponential race of pagedllm/kernels/race.py, exactly as
the engine's steps of such rows alone draw it there (over chunks of the row, or each rank over its slice of the
vocabulary). A filtered row's draw is by inverse CDF over the lanes: one pass keeps each lane's max and sum of
exp(x / T - max) over the tokens the row keeps (online, as a softmax), then the lane where a uniform share of the total
falls is picked from the lanes' running sums, and the token inside it from the running sum of its own few tokens. One
uniform number per draw. Every draw is keyed by the row's 64-bit Philox key: a seeded request keys by (seed,
position), so it gets the same token whatever shares its batch; the others by the step's key plus the row.

Filters. min-p keeps x / T >= max(x / T) + log(min_p): a threshold after a pass for the max. top-p is drawn by
rejection: a draw is kept when the tokens more likely than it weigh less than top_p of the kept mass (the sorted
cumsum rule of HF's TopPLogitsWarper); otherwise the row is drawn again among the tokens more likely than the
rejected one. Every round draws from a set that holds the whole nucleus, so the kept draw follows the renormalized
nucleus exactly, and the first round is kept with probability >= top_p. The pass that weighs the tokens above a draw
is also the next round's weighing pass: a round costs one pass over the row (in L2).

top-k keeps the tokens at or above the k-th largest value (ties all kept, as HF's TopKLogitsWarper). At least k
tokens reach the k-th largest lane maximum, so a pass lists the tokens at or above it (a few more than k) with their
x / T, each claiming its place with an atomic add (no scan per tile). A list of up to SMALL entries is sorted in
registers: the k-th entry, then top-p's cut (the first entry whose running mass reaches top_p of what top-k keeps)
are read off it, and the token drawn by inverse CDF over it. On a longer list (many equal values) the k-th largest
value and then top-p's cut are found by a multi-way search over float32 values (as order-preserving int32 keys: each
pass counts the entries, or sums their mass, at PIVOTS points of the remaining interval at once) over the list made
again in token order (so that the sums and the draw do not depend on the order of the atomic adds), and the token is
drawn from the list by the exponential race (Gumbel-max: argmax_i x_i / T - log E_i with E_i ~ Exp(1) from Philox,
counted by token). Where the list would be too long to store (or k is beyond the lanes), the k-th largest value is
searched over the row itself and top-p drawn by rejection over the row.

As the torch path: NaN logits are never drawn (nor taken by the argmax), +inf counts as the largest float (it wins),
a row with every token at -inf takes token 0. Exact up to float32 rounding of the sums and of the uniform (2**-24 of
the mass). The draws depend on BLOCK (it lays out the lanes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedllm.kernels.launch import Launch, Memory
from pagedllm.kernels.logprobs import LIST, _rank, row_logprobs
from pagedllm.kernels.logprobs import TILE as LP_TILE
from pagedllm.kernels.penalties import penalize_in_place, penalize_row, restore_row
from pagedllm.kernels.race import QUADS, _log_exp1, race_over
from pagedllm.kernels.row_passes import (
    _LOG2E,
    _at_or_above,
    _collect,
    _gather,
    _key,
    _kth_largest,
    _lane_max,
    _search,
    _sorted_list,
    _tile,
    _tokens,
)
from pagedllm.kernels.sampling_inputs import GREEDY_BELOW, PARAMS, DeviceInputs

_GREEDY_BELOW = tl.constexpr(GREEDY_BELOW)
_QUADS = tl.constexpr(QUADS)  # the race's tile (its draws do not depend on it)
_BLOCK = 1024  # lanes of a pass over a row
_DEPTH = 2  # blocks of tokens per iteration of a pass (more loads in flight)
_WARPS = 8  # warps per program (BLOCK >= 1024); 16 was no faster
_PIVOTS = 16  # points per threshold-search pass
_SMALL = 256  # entries per tile of a candidate list
_CAP = 8192  # candidates listed per top-k row: more, and the row itself is searched
_ROUND = tl.constexpr(1 << 30)  # the Philox counter of a draw's uniform, plus the round (counters by token stay below)


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
    row_ptr, vocab, inv_t, top, lane_top, floor, top_k, top_p, vals_ptr, ids_ptr, count_ptr, cap, TILE: tl.constexpr,
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
        count = _collect(row_ptr, vocab, inv_t, lo, hi, vals_ptr, ids_ptr, count_ptr, cap, TILE, DEPTH)
        if (count > SMALL) & (count <= cap):  # searched and drawn from: listed again, in token order
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


# the ints that vary from step to step are plain values: Triton would compile this large kernel again (seconds, while
# the engine waits) for each new mix of them equal to 1 or divisible by 16. Likewise the 16-byte alignment of the int
# buffers read and written at row offsets it cannot know (scalar loads, rows of 13 words): the state and step words
# may be views at any offset (one upload of both), and the alignment would only choose another variant of the same code
@triton.jit(
    do_not_specialize=["batch", "num_pen", "tokens_at", "token_cap", "num_top", "copied", "advance", "step_key"],
    do_not_specialize_on_alignment=["state_ptr", "step_ptr", "out_ptr", "lp_ptr"],
)
def sample_kernel(
    logits_ptr,  # [batch, vocab] float32 / bfloat16 / float16, unit stride along the vocabulary
    state_ptr,  # int32 (sampling_inputs.py): [rows, PARAMS] each state row's parameters, then [rows, token_cap] tokens
    step_ptr,  # int32 (sampling_inputs.step_words): [batch] state rows, [batch] penalized places, [batch] logprobs
    # places, [batch] the logits rows in the order of their programs, [batch] patches' starts, [wanted] the rows
    # that want logprobs, the patches
    out_ptr,  # [batch] int64
    scratch_ptr,  # int32 words: the top-k lists, the logprobs' lists, the penalties' counts, a counter per program
    work_ptr,  # [penalized, vocab] logits' dtype: the penalized copies of those rows
    source_ptr,  # [.., vocab] the logits the logprobs read: the step's (copied 0) or copies of the wanted rows (1)
    lp_ptr,  # [wanted, 4 + 2 num_top] int32 out: pagedllm/kernels/logprobs.py's rows
    batch,
    vocab,
    stride_row,
    stride_source,
    cap,
    num_pen,
    tokens_at,  # where the state's tokens start: rows x PARAMS
    token_cap,
    num_top,
    copied,
    advance,  # 1: advance the state (each row's position; a penalized row's tokens take the sampled one)
    step_key,  # int64: the key of unseeded rows is step_key + row
    PARAMS: tl.constexpr,  # words per row of params
    BLOCK: tl.constexpr,
    DEPTH: tl.constexpr,  # a pass reads DEPTH x BLOCK tokens per iteration (the same lanes; more loads in flight)
    PER_LANE: tl.constexpr,  # a power of 2 >= the tokens per lane (vocab / BLOCK)
    SMALL: tl.constexpr,  # entries per tile of a top-k row's candidate list (and of its search over the row)
    PIVOTS: tl.constexpr,
    LP_TILE: tl.constexpr,  # lanes of the logprobs' passes
    LIST: tl.constexpr,  # their top-n candidates sorted in registers
):
    program = tl.program_id(0)
    wanted_rows = tl.num_programs(0) - batch  # one program more per row that wants logprobs
    sources_ptr = step_ptr + 5 * batch  # [wanted] each wanted row's place in the batch
    lists = batch.to(tl.int64) * cap  # scratch: [batch, cap] float32 values, [batch, cap] tokens, then
    lp_lists = scratch_ptr + 2 * lists  # [wanted, LIST] float32 values, [wanted, LIST] tokens, then
    tables = lp_lists + 2 * wanted_rows * LIST  # [penalized, vocab] counts, then
    counter = tables + num_pen * vocab + program  # [batch + wanted] one int32 per program
    lp_width = 4 + 2 * num_top
    if program < wanted_rows:  # the log-sum-exp and the top tokens of a wanted row, from the logits as they are
        j = program
        place = tl.where(copied != 0, j, tl.load(sources_ptr + j))
        row_logprobs(
            source_ptr + place.to(tl.int64) * stride_source, lp_ptr + j * lp_width,
            (lp_lists + j * LIST).to(tl.pointer_type(tl.float32)), lp_lists + (wanted_rows + j) * LIST, counter,
            vocab, num_top, -1, LP_TILE, LIST, PIVOTS,
        )  # fmt: skip
    else:
        row = tl.load(step_ptr + 3 * batch + program - wanted_rows)
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        state_row = tl.load(step_ptr + row).to(tl.int64)
        params_ptr = state_ptr + state_row * PARAMS
        floats = params_ptr.to(tl.pointer_type(tl.float32))
        tokens_ptr = state_ptr + tokens_at + state_row * token_cap
        patch = tl.load(step_ptr + 4 * batch + row)
        if patch >= 0:  # the row joins the state, once: steps that reuse these words find no patch
            _write_patch(step_ptr + patch, params_ptr, tokens_ptr, PARAMS, BLOCK)
            tl.store(step_ptr + 4 * batch + row, -1)
        num_tokens = tl.load(params_ptr + 9)
        penalized = tl.load(step_ptr + batch + row)
        wanted = tl.load(step_ptr + 2 * batch + row)
        wants_logprobs = (wanted >= 0) & (wanted < wanted_rows)
        work = work_ptr + penalized.to(tl.int64) * vocab  # a penalized row's
        if penalized >= 0:
            table = tables + penalized.to(tl.int64) * vocab
            num_prompt, rep, presence, frequency = (
                tl.load(params_ptr + 8), tl.load(floats + 10), tl.load(floats + 11), tl.load(floats + 12)
            )  # fmt: skip
            if wants_logprobs:  # its logprobs read the row as it is: sample from a penalized copy
                penalize_row(row_ptr, work, table, tokens_ptr, num_prompt, num_tokens, rep, presence, frequency,
                             vocab, BLOCK, 512)  # fmt: skip
                row_ptr = work
            else:  # the work row keeps the logits it changes (put back below)
                penalize_in_place(row_ptr, work, table, tokens_ptr, num_prompt, num_tokens, rep, presence,
                                  frequency, 512)  # fmt: skip
        temperature = tl.load(floats)
        if temperature < _GREEDY_BELOW:
            token = _argmax(row_ptr, vocab, BLOCK, DEPTH)
        else:
            vals = (scratch_ptr + row * cap).to(tl.pointer_type(tl.float32))
            token = _draw_row(row_ptr, row, floats, vals, scratch_ptr + lists + row * cap, counter, vocab, cap,
                              temperature, step_key, BLOCK, DEPTH, PER_LANE, SMALL, PIVOTS)  # fmt: skip
        tl.store(out_ptr + row, token.to(tl.int64))
        if (penalized >= 0) & (wants_logprobs == 0):  # the logits as they were (before the token list grows)
            restore_row(row_ptr, work, tokens_ptr, num_tokens, 512)
        if advance != 0:  # the state as the next step finds it: every thread has read it by now (the draw's sums)
            tl.store(params_ptr + 6, tl.load(params_ptr + 6) + 1)
            if penalized >= 0:
                tl.store(tokens_ptr + num_tokens, token)
                tl.store(params_ptr + 9, num_tokens + 1)
        if wants_logprobs:  # the sampled token's rank and logit, in the logits as they are
            place = tl.where(copied != 0, wanted, tl.load(sources_ptr + wanted))
            src = source_ptr + place.to(tl.int64) * stride_source
            c = _tokens(src, token.to(tl.int64) + tl.zeros([1], tl.int64), vocab, 1.0)  # [1]
            out = lp_ptr + wanted * lp_width
            tl.store(out, token)
            rank = tl.full([], 1, tl.int32)  # an argmax over the logits the logprobs read: nothing lies above it
            if (temperature >= _GREEDY_BELOW) | (penalized >= 0) | (copied != 0):
                rank = _rank(src, vocab, c, LP_TILE)
            tl.store(out + 1, rank)
            tl.store(out.to(tl.pointer_type(tl.float32)) + 2, tl.sum(c, 0))


_launch = Launch(sample_kernel)


@triton.jit
def _write_patch(patch_ptr, params_ptr, tokens_ptr, PARAMS: tl.constexpr, BLOCK: tl.constexpr):
    """A row's state from its patch: its PARAMS words, then its tokens (its NUM_TOKENS word: how many)."""
    i = tl.arange(0, 16)
    tl.store(params_ptr + i, tl.load(patch_ptr + i, mask=i < PARAMS), mask=i < PARAMS)
    n = tl.load(patch_ptr + 9)
    for start in range(0, n, BLOCK):
        j = start + tl.arange(0, BLOCK)
        tl.store(tokens_ptr + j, tl.load(patch_ptr + PARAMS + j, mask=j < n), mask=j < n)
    tl.debug_barrier()  # the state is read by every thread of the program


@triton.jit
def _draw_row(
    row_ptr, row, floats, vals_ptr, ids_ptr, count_ptr, vocab, cap, temperature, step_key, BLOCK: tl.constexpr,
    DEPTH: tl.constexpr, PER_LANE: tl.constexpr, SMALL: tl.constexpr, PIVOTS: tl.constexpr,
):  # fmt: skip
    """A token drawn from softmax(x / T) after min-p, top-k and top-p (the row's parameters at floats)."""
    inv_t = 1.0 / temperature
    top_k = tl.load(floats + 1).to(tl.int32)
    top_p = tl.load(floats + 2)
    min_p = tl.load(floats + 3)
    words = floats.to(tl.pointer_type(tl.int32)) + 4
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
                    row_ptr, vocab, inv_t, top, lane_top, floor, top_k, top_p, vals_ptr, ids_ptr, count_ptr, cap, BLOCK,
                    DEPTH, SMALL, PIVOTS,
                )  # fmt: skip
    if (min_p <= 0) & (top_k <= 0) & (top_p >= 1.0):  # a plain row: as pagedllm/kernels/race.py draws it
        token = race_over(row_ptr, vocab, inv_t, key, _QUADS)
    elif listed > SMALL:
        token = _race_listed(vals_ptr, ids_ptr, listed, key, floor.to(tl.int32), SMALL)
    elif listed >= 0:
        token = _draw_sorted(vals_ptr, ids_ptr, listed, top, top_k, top_p, _uniform(key, 0), SMALL)
    else:
        token = _draw_by_rejection(row_ptr, vocab, inv_t, floor.to(tl.int32), top_p, key, BLOCK, DEPTH, PER_LANE)
    return token


def sample(
    logits: torch.Tensor,  # [batch, vocab]
    inputs: DeviceInputs,  # the state and the step's words (sampling_inputs.py)
    step_key: int,  # in [0, 2**62): the unseeded rows' keys are step_key + row
    logprobs: Logprobs | None = None,
    block: int = _BLOCK,
    cap: int = _CAP,
    work: torch.Tensor | None = None,  # [num_pen, vocab] logits' dtype: where the penalized rows go (default new)
    memory: Memory | None = None,  # working memory kept from launch to launch (default: new allocations)
    out: torch.Tensor | None = None,  # [batch] int64: where the tokens go (default new)
) -> torch.Tensor:
    """One token per row of logits: the argmax, or a draw from softmax(x / T) after min-p, top-k and top-p, of the
    row as it is or with its penalties; and the logprobs the rows want into logprobs.out. Where inputs.advance, the
    kernel advances the state past the sampled tokens. Launches one kernel and never waits for the device. block:
    lanes per pass (a power of 2; the draws depend on it). Kernels that share memory must run one after another (on
    one stream)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    batch, vocab = logits.shape
    dev = logits.device
    out = torch.empty(batch, dtype=torch.int64, device=dev) if out is None else out
    if not batch:
        return out
    cap = min(cap, vocab)
    num_pen = inputs.num_pen
    lp = logprobs if logprobs is not None else Logprobs(logits, inputs.step, 0, False)  # no program writes it
    wanted = lp.out.shape[0] if logprobs is not None else 0
    source = lp.source if lp.source.stride(-1) == 1 else lp.source.contiguous()
    memory = memory if memory is not None else Memory()
    scratch = memory.take("scratch", (2 * batch * cap + 2 * wanted * LIST + num_pen * vocab + batch + wanted,), dev)
    if work is None:
        work = memory.take("work", (num_pen, vocab), dev, logits.dtype) if num_pen else logits
    _launch(
        batch + wanted,
        logits, inputs.state, inputs.step, out, scratch, work, source, lp.out, batch, vocab, logits.stride(0),
        source.stride(0), cap, num_pen, inputs.num_rows * PARAMS, inputs.token_cap, lp.num_top, int(lp.copied),
        int(inputs.advance), step_key, PARAMS=PARAMS, BLOCK=block, DEPTH=_DEPTH,
        PER_LANE=triton.next_power_of_2(triton.cdiv(vocab, block)), SMALL=min(block, _SMALL), PIVOTS=_PIVOTS,
        LP_TILE=LP_TILE, LIST=LIST, num_warps=_WARPS if block >= 1024 else 4,
    )  # fmt: skip
    return out


@dataclass
class Logprobs:
    """What the sampling kernel needs for the logprobs of the rows that want them (listed in its inputs)."""

    source: torch.Tensor  # [.., vocab] the logits the logprobs read (before any change), unit stride along the
    # vocabulary: the step's, or copies of the wanted rows
    out: torch.Tensor  # [wanted, 4 + 2 num_top] int32: the kernel's output (pagedllm/kernels/logprobs.py's rows)
    num_top: int  # the top logprobs per row (the most any row wants)
    copied: bool  # source holds copies of the wanted rows, in order (else the step's logits)
