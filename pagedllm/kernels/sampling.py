"""The sampler's plain rows (temperature, optionally min-p; no top-k / top-p) on the GPU: one launch, one program per
row, the logits read in place.

The exponential race: with probabilities p_i = softmax(x / T)_i and independent E_i ~ Exp(1), argmax_i p_i / E_i is
a draw from p exactly (P(i wins) = p_i / sum_j p_j). In log space that is argmax_i (x_i / T - log E_i) (the Gumbel-max
trick), which needs neither the softmax's max nor its sum: one pass over the row, keeping a running (best score,
best index) per lane, then a reduction over the lanes.

E_i = -log(1 - u_i) with u_i from Triton's Philox, keyed by the row's 64-bit key and counted by token, so a row's
draw depends only on its logits, temperature, min-p and key (a seeded request keys by (seed, position): the same
token whatever shares its batch). The race is won by small E (the winner's E is about p_i / sum p), so E is made
precise there: u = bits / 2**32 keeps full float precision near 0 and -log(1 - u) is a series for u < 2**-5.

As the torch path: NaN logits are never drawn, +inf counts as the largest float (it wins), a row with every token at
-inf takes token 0, and min-p drops tokens with p < min_p * max p, i.e. x / T < max(x / T) + log(min_p) (with the
row's max from a first pass over the row). Exact up to float32 rounding of x / T - log E: where |x / T| is so large
(beyond ~1e6) that the noise is lost in it, equal scores go to the lowest token (several +inf logits: the first),
where the torch path draws among them uniformly. The draws depend on BLOCK (it lays out the Philox counters)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_FLOAT_MAX = tl.constexpr(3.4028234663852886e38)  # +inf logits become this
_BLOCK = 2048  # tokens per loop iteration: 4 streams of _BLOCK // 4 Philox counters


@triton.jit
def _scaled(x, inv_t):
    """x / T in float32 with NaN -> -inf (never drawn) and +inf -> the largest float."""
    s = x.to(tl.float32) * inv_t
    s = tl.where(s == s, s, float("-inf"))
    return tl.minimum(s, _FLOAT_MAX)


@triton.jit
def _log_exp1(bits):
    """log E for E ~ Exp(1) from uint32 random bits: E = -log(1 - u), u = (bits + 1/2) / 2**32 in (0, 1)."""
    u = tl.minimum((bits.to(tl.float32) + 0.5) * 2.3283064365386963e-10, 0.99999994)
    series = u * (1.0 + u * (0.5 + u * (0.33333334 + u * 0.25)))  # -log(1 - u), relative error < 2e-7 below 2**-5
    return tl.log(tl.where(u < 0.03125, series, -tl.log(1.0 - u)))


@triton.jit
def _race(best, best_idx, row_ptr, idx, bits, inv_t, floor, vocab, HAS_MIN_P: tl.constexpr):
    """One quarter tile: the running best (score, token) per lane, updated with tokens idx [QUARTER]."""
    ok = idx < vocab
    s = _scaled(tl.load(row_ptr + idx, mask=ok, other=float("-inf")), inv_t)
    if HAS_MIN_P:
        s = tl.where(s >= floor, s, float("-inf"))
    score = s - _log_exp1(bits)  # -inf stays -inf: banned tokens never win
    better = score > best  # strict: the first of equal scores stays (a row of -inf keeps token 0)
    return tl.where(better, score, best), tl.where(better, idx, best_idx)


@triton.jit
def sample_plain_kernel(
    logits_ptr,  # [batch, vocab] float32 / bfloat16 / float16, unit stride along the vocabulary
    sample_rows_ptr,  # [num_sample] int64: batch row of each sampled row
    plain_ptr,  # [num_plain] int64: positions in sample_rows to draw here (one program each)
    temperature_ptr,  # [num_sample] float32 (> 0)
    keys_ptr,  # [num_sample] int64: Philox key of each sampled row
    min_p_ptr,  # [num_sample] float32 (HAS_MIN_P)
    out_ptr,  # [batch] int64: the token of each drawn row is written at its batch row
    vocab,
    stride_row,
    BLOCK: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
):
    j = tl.load(plain_ptr + tl.program_id(0))
    row = tl.load(sample_rows_ptr + j)
    inv_t = 1.0 / tl.load(temperature_ptr + j)
    key = tl.load(keys_ptr + j)
    row_ptr = logits_ptr + row * stride_row
    QUARTER: tl.constexpr = BLOCK // 4
    lanes = tl.arange(0, QUARTER)
    floor = float("-inf")
    if HAS_MIN_P:  # first pass: the row's max of x / T
        top = tl.full([QUARTER], float("-inf"), tl.float32)
        for start in range(0, vocab, QUARTER):
            idx = start + lanes
            x = tl.load(row_ptr + idx, mask=idx < vocab, other=float("-inf"))
            top = tl.maximum(top, _scaled(x, inv_t))
        floor = tl.max(top, 0) + tl.log(tl.load(min_p_ptr + j))  # min_p = 0: -inf, nothing dropped
    best = tl.full([QUARTER], float("-inf"), tl.float32)
    best_idx = tl.zeros([QUARTER], tl.int32)
    for start in range(0, vocab, BLOCK):
        b0, b1, b2, b3 = tl.randint4x(key, start // 4 + lanes)  # counters unique per (row, tile, lane)
        idx = start + lanes
        best, best_idx = _race(best, best_idx, row_ptr, idx, b0, inv_t, floor, vocab, HAS_MIN_P)
        best, best_idx = _race(best, best_idx, row_ptr, idx + QUARTER, b1, inv_t, floor, vocab, HAS_MIN_P)
        best, best_idx = _race(best, best_idx, row_ptr, idx + 2 * QUARTER, b2, inv_t, floor, vocab, HAS_MIN_P)
        best, best_idx = _race(best, best_idx, row_ptr, idx + 3 * QUARTER, b3, inv_t, floor, vocab, HAS_MIN_P)
    top_score = tl.max(best, 0)
    token = tl.min(tl.where(best == top_score, best_idx, vocab), 0)  # ties (all -inf): the lowest token
    tl.store(out_ptr + row, token.to(tl.int64))


def sample_plain(
    logits: torch.Tensor,  # [batch, vocab]
    sample_rows: torch.Tensor,  # [num_sample] int64
    plain: torch.Tensor,  # [num_plain] int64: positions in sample_rows
    temperature: torch.Tensor,  # [num_sample] float32
    keys: torch.Tensor,  # [num_sample] int64
    min_p: torch.Tensor | None,  # [num_sample] float32, or None: no min-p
    out: torch.Tensor,  # [batch] int64
    block: int = _BLOCK,
) -> None:
    """Draws the rows sample_rows[plain] of logits (softmax(x / T), min-p filtered) into out at their batch rows.
    Launches one kernel and never waits for the device. block: tokens per loop iteration (a power of 2 >= 4; the
    draws depend on it)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if not len(plain):
        return
    sample_plain_kernel[(len(plain),)](
        logits,
        sample_rows,
        plain,
        temperature,
        keys,
        temperature if min_p is None else min_p,
        out,
        logits.shape[1],
        logits.stride(0),
        BLOCK=block,
        HAS_MIN_P=min_p is not None,
        num_warps=16 if block >= 2048 else 4,
    )
