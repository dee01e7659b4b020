"""Sampling as a race over the vocabulary, for rows without filters (greedy or temperature only): the token is the
argmax over the row of score(t) = x_t / T - log E_t, with E_t ~ Exp(1) drawn by Philox from (the row's key, token
id t) (the exponential race, or Gumbel-max: it draws exactly from softmax(x / T)); a greedy row's score is x_t.
Every token's score depends on the token alone, so any split of the vocabulary finds the same winner: the programs
of a row each race over a chunk of it, and with tensor parallelism each rank over its slice of the LM head's logits,
with no rank holding the whole row. A winner travels as one int64 that orders as (score, lowest token first), so the
chunks, and then the ranks, combine by a max (an atomic max, then an all-reduce).

The sampling kernel (sampling.py) draws its plain rows with race_over (one program over the whole row), which gives
the same token as race_kernel over any chunks or slices: a seeded request gets the same token whatever shares its
batch and whatever the tensor-parallel size. NaN logits never win; +inf wins (the lowest such token); a row with every
token at -inf takes its lowest token.

Philox numbers come four per counter: token t takes word t % 4 of counter t // 4."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.launch import Launch
from pagedllm.kernels.row_passes import _key
from pagedllm.kernels.sampling_inputs import GREEDY_BELOW

NONE = -(2**63)  # the packed value no token beats (a chunk's start)
_NONE = tl.constexpr(NONE)
_GREEDY_BELOW = tl.constexpr(GREEDY_BELOW)
_BIG = tl.constexpr(2147483647)  # no token (a lane that has seen none)
QUADS = 256  # counters (of four tokens) per tile: 1,024 tokens
CHUNKS_PER_SM = 8  # programs wanted per SM (rows x chunks): the chunk shrinks until there are as many
MIN_CHUNK = 4096


@triton.jit
def _log_exp1(bits):
    """log E for E ~ Exp(1) from uint32 random bits: E = -log(1 - u), u = (bits + 1/2) / 2**32 in (0, 1)."""
    u = tl.minimum((bits.to(tl.float32) + 0.5) * 2.3283064365386963e-10, 0.99999994)
    series = u * (1.0 + u * (0.5 + u * (0.33333334 + u * 0.25)))  # -log(1 - u), relative error < 2e-7 below 2**-5
    return tl.log(tl.where(u < 0.03125, series, -tl.log(1.0 - u)))


@triton.jit
def _scores(row_ptr, base, first, count, inv_t, key, QUADS: tl.constexpr):
    """The scores [QUADS, 4] of tokens base + 4q + j (base % 4 == 0) whose logits lie at row_ptr[token - first] for
    0 <= token - first < count, their tokens, and which of them lie there."""
    quad = tl.arange(0, QUADS)
    lane = tl.arange(0, 4)[None, :]
    token = base + 4 * quad[:, None] + lane
    local = token - first
    valid = (local >= 0) & (local < count)
    x = tl.load(row_ptr + local, mask=valid, other=float("-inf")).to(tl.float32)
    x = tl.where(x == x, x, float("-inf"))  # NaN never wins
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 ties with 0.0 (the packed scores would order them)
    if inv_t > 0:
        r0, r1, r2, r3 = tl.randint4x(key, base // 4 + quad)
        bits = tl.where(lane < 2, tl.where(lane == 0, r0[:, None], r1[:, None]),
                        tl.where(lane == 2, r2[:, None], r3[:, None]))  # fmt: skip
        x = x * inv_t - _log_exp1(bits)
    return x, token, valid


@triton.jit
def _race(row_ptr, lo, span, first, count, inv_t, key, QUADS: tl.constexpr):
    """The best (score, token) over tokens [lo, lo + span) (lo % 4 == 0) held at row_ptr[token - first] (0 <= token -
    first < count): of equal scores the lowest token; a span holding none: (-inf, _BIG)."""
    best = tl.full([QUADS, 4], float("-inf"), tl.float32)
    best_token = tl.full([QUADS, 4], _BIG, tl.int32)
    for offset in range(0, span, 4 * QUADS):
        s, token, valid = _scores(row_ptr, lo + offset, first, count, inv_t, key, QUADS)
        better = valid & ((s > best) | (best_token == _BIG))  # a lane's first token, then strictly better ones
        best, best_token = tl.where(better, s, best), tl.where(better, token, best_token)
    top = tl.max(tl.max(best, 1), 0)
    return top, tl.min(tl.min(tl.where(best == top, best_token, _BIG), 1), 0)


@triton.jit
def race_over(row_ptr, vocab, inv_t, key, QUADS: tl.constexpr):
    """The race's token over a whole row of vocab logits (inv_t 0: the argmax). int32 scalar"""
    return _race(row_ptr, 0, vocab, 0, vocab, inv_t, key, QUADS)[1]


@triton.jit
def _pack(score, token):
    """(score, token) as an int64 that orders as the score, then as the lower token."""
    return (_key(score).to(tl.int64) << 32) | (tl.full([], _BIG, tl.int32) - token).to(tl.int64)


# the ints vary from step to step and rank to rank, and the small arrays are views at any offset: one compiled variant
@triton.jit(
    do_not_specialize=["stride_row", "first", "count", "chunk", "chunks"],
    do_not_specialize_on_alignment=["keys_ptr", "temperature_ptr", "packed_ptr"],
)
def race_kernel(
    logits_ptr,  # [rows, count] this slice of the vocabulary's logits, unit stride along it
    keys_ptr,  # [rows] int64 each row's Philox key
    temperature_ptr,  # [rows] float32 (below GREEDY_BELOW: the argmax)
    packed_ptr,  # [rows] int64: the best (score, token) so far (NONE before any), raised by atomic max
    stride_row,
    first,  # the slice's first token
    count,  # tokens in the slice
    chunk,  # tokens per program (a multiple of 4 QUADS)
    chunks,  # programs per row
    QUADS: tl.constexpr,
):
    program = tl.program_id(0)
    row, part = program // chunks, program % chunks
    lo = first - first % 4 + part * chunk
    temperature = tl.load(temperature_ptr + row)
    inv_t = tl.where(temperature >= _GREEDY_BELOW, 1.0 / temperature, 0.0)  # as the sampling kernel divides
    span = tl.minimum(chunk, first + count - lo)  # the last chunk ends with the slice
    top, token = _race(
        logits_ptr + row.to(tl.int64) * stride_row, lo, span, first, count, inv_t, tl.load(keys_ptr + row), QUADS
    )
    tl.atomic_max(packed_ptr + row, _pack(top, token))


@triton.jit
def tokens_kernel(packed_ptr, out_ptr, rows, BLOCK: tl.constexpr):
    """The winners' tokens out of the packed values, which start over (NONE) for the next race."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    packed = tl.load(packed_ptr + i, mask=i < rows)
    tl.store(out_ptr + i, tl.full([], _BIG, tl.int64) - (packed & 0xFFFFFFFF), mask=i < rows)
    tl.store(packed_ptr + i, tl.full([BLOCK], _NONE, tl.int64), mask=i < rows)


_race_launch = Launch(race_kernel)
_tokens_launch = Launch(tokens_kernel)


def chunk_size(rows: int, count: int, num_sms: int) -> int:
    """Tokens per program: a power of two, at least MIN_CHUNK (a multiple of 4 QUADS), small enough that rows x
    chunks reaches CHUNKS_PER_SM programs per SM where the row is long enough."""
    chunks = max(1, -(-CHUNKS_PER_SM * num_sms // max(rows, 1)))
    chunk = triton.next_power_of_2(max(1, -(-count // chunks)))
    return max(MIN_CHUNK, chunk)


def race(
    logits: torch.Tensor,
    keys: torch.Tensor,
    temperature: torch.Tensor,
    packed: torch.Tensor,
    first: int,
    num_sms: int,
) -> None:
    """Raises packed [rows] (int64: NONE, or an earlier slice's winners) to the winners over this slice of the
    vocabulary: logits [rows, count] (unit stride along it) hold tokens [first, first + count). keys [rows] int64,
    temperature [rows] float32 (below GREEDY_BELOW: the argmax)."""
    rows, count = logits.shape
    if not rows:
        return
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    span = count + first % 4  # from the counter of four tokens that holds the slice's first
    chunk = chunk_size(rows, span, num_sms)
    chunks = -(-span // chunk)
    _race_launch(rows * chunks, logits, keys, temperature, packed, logits.stride(0), first, count, chunk, chunks,
                 QUADS=QUADS, num_warps=4)  # fmt: skip


def tokens(packed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [rows] int64 = the tokens of the packed winners [rows]; packed starts over (NONE)."""
    rows = packed.shape[0]
    if rows:
        _tokens_launch(triton.cdiv(rows, 256), packed, out, rows, BLOCK=256, num_warps=4)
    return out
