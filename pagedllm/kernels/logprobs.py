"""Logprobs on the GPU without a sort of the vocabulary or a host sync: per row the log-sum-exp, the chosen token's
logit and rank, and the top-n tokens with their logprobs, in one buffer (one copy to the host). The sampling kernel
(pagedllm/kernels/sampling.py) runs the same passes for the rows whose sampled tokens want logprobs; logprobs()
here serves tokens known beforehand (prompt logprobs).

One pass keeps per lane a running max and sum of exp (the log-sum-exp), the count of tokens above the chosen one
(its rank) and the lane's max. At least n tokens reach the n-th largest lane max, so a second pass lists the tokens
at or above it (a few more than n, in no set order: each claims its place with an atomic add) and the list is sorted
in registers. Where that list would be too long (many equal logits), the n-th largest value is searched for exactly
(as the sampler's top-k) and the list holds the tokens above it, then those equal to it. As in the sampler, NaN
logits count as -inf and +inf as the largest float.

A row of the buffer (pagedllm/sample/logprobs.py's pack_logprobs): the chosen token, its rank, its logit and
the log-sum-exp (float32 bits; the logprob is their difference, taken on the host), the top-n tokens, their logprobs
(float32 bits)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.row_passes import (
    _LOG2E,
    _collect,
    _gather,
    _key,
    _kth_largest,
    _search,
    _sorted_list,
    _tile,
    _tokens,
)

TILE = 1024  # lanes of a pass over a row
LIST = 128  # top-n candidates sorted in registers
PIVOTS = 16


@triton.jit
def _logsumexp(row_ptr, vocab, c, TILE: tl.constexpr):
    """The row's log-sum-exp, its lanes' maxima and how many tokens lie above c ([1] float32). (scalar, [TILE],
    scalar)"""
    lane_top = tl.full([TILE], float("-inf"), tl.float32)
    lane_sum = tl.zeros([TILE], tl.float32)  # sum of exp(x - lane_top)
    above = tl.zeros([TILE], tl.int32)
    for start in range(0, vocab, TILE):
        s = _tile(row_ptr, start, vocab, 1.0, TILE, 1)[0]
        new_top = tl.maximum(lane_top, tl.max(s, 0))
        safe = tl.where(new_top == float("-inf"), 0.0, new_top)  # no -inf - -inf
        lane_sum = lane_sum * tl.exp2((lane_top - safe) * _LOG2E) + tl.sum(tl.exp2((s - safe[None, :]) * _LOG2E), 0)
        lane_top = new_top
        above += tl.sum((s > c[:, None]).to(tl.int32), 0)
    top = tl.max(lane_top, 0)
    safe_top = tl.where(top == float("-inf"), 0.0, top)
    lse = safe_top + tl.log(tl.sum(lane_sum * tl.exp2((lane_top - safe_top) * _LOG2E), 0))
    return lse, lane_top, tl.sum(above, 0)


@triton.jit
def _rank(row_ptr, vocab, c, TILE: tl.constexpr):
    """1 + how many tokens lie above c ([1] float32): the rank of a token of logit c."""
    above = tl.zeros([TILE], tl.int32)
    for start in range(0, vocab, TILE * 2):
        s = _tile(row_ptr, start, vocab, 1.0, TILE, 2)[0]
        above += tl.sum((s > c[:, None]).to(tl.int32), 0)
    return tl.sum(above, 0) + 1


@triton.jit
def row_logprobs(
    row_ptr,  # [vocab] the logits
    out_ptr,  # the row of the buffer: words 3 on (and 0-2 where chosen >= 0)
    vals_ptr,  # [LIST] float32 scratch
    ids_ptr,  # [LIST] int32 scratch
    count_ptr,  # one int32 of scratch
    vocab,
    num_top,
    chosen,  # int32: the token whose rank and logit are wanted; < 0: none (its words stay)
    TILE: tl.constexpr,
    LIST: tl.constexpr,
    PIVOTS: tl.constexpr,
):
    """A row's log-sum-exp and top num_top tokens with their logprobs (and the chosen token's rank and logit)."""
    out_lp = out_ptr.to(tl.pointer_type(tl.float32))  # the float32 words
    c = _tokens(row_ptr, tl.maximum(chosen, 0) + tl.zeros([1], tl.int64), vocab, 1.0)  # [1]
    lse, lane_top, above = _logsumexp(row_ptr, vocab, c, TILE)
    if chosen >= 0:
        tl.store(out_ptr, chosen)
        tl.store(out_ptr + 1, above + 1)
        tl.store(out_lp + 2, tl.sum(c, 0))
    tl.store(out_lp + 3, lse)
    if num_top > 0:
        top = tl.max(lane_top, 0)
        hi = _key(top).to(tl.int64) + 1
        lo = _kth_largest(lane_top, num_top, TILE)  # at least num_top tokens are at or above it
        count = _collect(row_ptr, vocab, 1.0, lo, hi, vals_ptr, ids_ptr, count_ptr, LIST, TILE, 1)
        if count > LIST:  # many equal values: the num_top-th largest exactly, then the tokens above and at it
            lo = _search(row_ptr, vocab, 1.0, top, lo, hi, num_top, False, False, TILE, PIVOTS)
            count = _gather(row_ptr, vocab, 1.0, lo + 1, hi, vals_ptr, ids_ptr, LIST, TILE, 1)
            ties = _gather(row_ptr, vocab, 1.0, lo, lo + 1, vals_ptr + count, ids_ptr + count, LIST - count, TILE, 1)
            count = tl.minimum(count + ties, LIST)
        v, token = _sorted_list(vals_ptr, ids_ptr, count, LIST)
        at = tl.arange(0, LIST)
        keep = at < num_top
        tl.store(out_ptr + 4 + at, token, mask=keep)
        tl.store(out_lp + 4 + num_top + at, v - lse, mask=keep)


# num_top changes from step to step: one compiled variant for every count (1 and multiples of 16 would each compile)
@triton.jit(do_not_specialize=["num_top"])
def logprobs_kernel(
    logits_ptr,  # [rows, vocab] float32 / bfloat16 / float16, unit stride along the vocabulary
    chosen_ptr,  # [rows] int64: the tokens whose logprob and rank are wanted
    out_ptr,  # [rows, 4 + 2 num_top] int32 out
    vals_ptr,  # [rows, LIST] float32 scratch
    ids_ptr,  # [rows, LIST + 1] int32 scratch: the list, then a counter
    vocab,
    stride_row,
    num_top,
    TILE: tl.constexpr,
    LIST: tl.constexpr,
    PIVOTS: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    chosen = tl.load(chosen_ptr + row).to(tl.int32)
    out_ptr += row * (4 + 2 * num_top)
    ids_ptr += row * (LIST + 1)
    row_logprobs(
        row_ptr, out_ptr, vals_ptr + row * LIST, ids_ptr, ids_ptr + LIST, vocab, num_top, chosen, TILE, LIST, PIVOTS
    )


def logprobs(
    logits: torch.Tensor,  # [rows, vocab]
    chosen: torch.Tensor,  # [rows] int64: the chosen tokens
    num_top: int,  # >= 0, at most LIST
) -> torch.Tensor:
    """Each row's chosen token, its rank, its logit and the row's log-sum-exp, then its top num_top tokens and their
    logprobs, on the device (no host sync). [rows, 4 + 2 num_top] int32"""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, dev = logits.shape[0], logits.device
    out = torch.empty(rows, 4 + 2 * num_top, dtype=torch.int32, device=dev)
    if rows:
        vals = torch.empty(rows, LIST, dtype=torch.float32, device=dev)
        ids = torch.empty(rows, LIST + 1, dtype=torch.int32, device=dev)
        logprobs_kernel[(rows,)](
            logits, chosen, out, vals, ids, logits.shape[1], logits.stride(0), num_top, TILE=TILE, LIST=LIST,
            PIVOTS=PIVOTS, num_warps=16,
        )  # fmt: skip
    return out
