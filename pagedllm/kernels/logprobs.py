"""Logprobs on the GPU in one launch: per row the log-sum-exp, the chosen token's logprob and rank, and the top-n
tokens with their logprobs, without a sort of the vocabulary or a host sync, into one buffer (one copy to the host).

One pass keeps per lane a running max and sum of exp (the log-sum-exp), the count of tokens above the chosen one
(its rank) and the lane's max. At least n tokens reach the n-th largest lane max, so a second pass lists the tokens
at or above it (a few more than n) and the list is sorted in registers. Where that list would be too long (many
equal logits), the n-th largest value is searched for exactly (as the sampler's top-k) and the list holds the tokens
above it, then those equal to it. As in the sampler, NaN logits count as -inf and +inf as the largest float."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.row_passes import _LOG2E, _gather, _key, _kth_largest, _search, _sorted_list, _tile, _tokens

_TILE = 1024  # lanes of a pass over a row
_DEPTH = 1  # tiles per iteration of a pass
_LIST = 128  # top-n candidates sorted in registers


@triton.jit
def logprobs_kernel(
    logits_ptr,  # [rows, vocab] float32 / bfloat16 / float16, unit stride along the vocabulary
    chosen_ptr,  # int64: the tokens whose logprob and rank are wanted, row r's at chosen_ptr[index_ptr[r]] (INDEXED)
    index_ptr,  # or chosen_ptr[r]
    out_ptr,  # [rows, 3 + 2 num_top] int32 out (pack_logprobs)
    vals_ptr,  # [rows, LIST] float32 scratch
    ids_ptr,  # [rows, LIST] int32 scratch
    vocab,
    stride_row,
    num_top,
    TILE: tl.constexpr,
    DEPTH: tl.constexpr,
    LIST: tl.constexpr,
    PIVOTS: tl.constexpr,
    INDEXED: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    chosen = tl.load(chosen_ptr + (tl.load(index_ptr + row) if INDEXED else row))
    out_ptr += row * (3 + 2 * num_top)
    out_lp = out_ptr.to(tl.pointer_type(tl.float32))  # the logprobs' float32 bits
    c = _tokens(row_ptr, chosen + tl.zeros([1], tl.int64), vocab, 1.0)  # [1]
    lane_top = tl.full([TILE], float("-inf"), tl.float32)
    lane_sum = tl.zeros([TILE], tl.float32)  # sum of exp(x - lane_top)
    above = tl.zeros([TILE], tl.int32)
    for start in range(0, vocab, TILE * DEPTH):
        s = _tile(row_ptr, start, vocab, 1.0, TILE, DEPTH)[0]
        new_top = tl.maximum(lane_top, tl.max(s, 0))
        safe = tl.where(new_top == float("-inf"), 0.0, new_top)  # no -inf - -inf
        lane_sum = lane_sum * tl.exp2((lane_top - safe) * _LOG2E) + tl.sum(tl.exp2((s - safe[None, :]) * _LOG2E), 0)
        lane_top = new_top
        above += tl.sum((s > c[:, None]).to(tl.int32), 0)
    top = tl.max(lane_top, 0)
    safe_top = tl.where(top == float("-inf"), 0.0, top)
    lse = safe_top + tl.log(tl.sum(lane_sum * tl.exp2((lane_top - safe_top) * _LOG2E), 0))
    tl.store(out_ptr, chosen.to(tl.int32))
    tl.store(out_ptr + 1, tl.sum(above, 0) + 1)
    tl.store(out_lp + 2, tl.sum(c, 0) - lse)
    if num_top > 0:
        vals, ids = vals_ptr + row * LIST, ids_ptr + row * LIST
        hi = _key(top).to(tl.int64) + 1
        lo = _kth_largest(lane_top, num_top, TILE)  # at least num_top tokens are at or above it
        count = _gather(row_ptr, vocab, 1.0, lo, hi, vals, ids, LIST, TILE, DEPTH)
        if count > LIST:  # many equal values: the num_top-th largest exactly, then the tokens above and at it
            lo = _search(row_ptr, vocab, 1.0, top, lo, hi, num_top, False, False, TILE, PIVOTS)
            count = _gather(row_ptr, vocab, 1.0, lo + 1, hi, vals, ids, LIST, TILE, DEPTH)
            ties = _gather(row_ptr, vocab, 1.0, lo, lo + 1, vals + count, ids + count, LIST - count, TILE, DEPTH)
            count = tl.minimum(count + ties, LIST)
        v, token = _sorted_list(vals, ids, count, LIST)
        at = tl.arange(0, LIST)
        keep = at < num_top
        tl.store(out_ptr + 3 + at, token, mask=keep)
        tl.store(out_lp + 3 + num_top + at, v - lse, mask=keep)


def logprobs(
    logits: torch.Tensor,  # [rows, vocab]
    chosen: torch.Tensor,  # int64: the chosen tokens, row r's at chosen[index[r]] (or chosen[r] without index)
    index: torch.Tensor | None,  # [rows] int64
    num_top: int,  # >= 0, at most _LIST
) -> torch.Tensor:
    """Each row's chosen token, its rank and logprob, then its top num_top tokens and their logprobs, on the device
    (no host sync), as pagedllm.worker.sample_inputs.pack_logprobs lays them out. [rows, 3 + 2 num_top] int32"""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, dev = logits.shape[0], logits.device
    out = torch.empty(rows, 3 + 2 * num_top, dtype=torch.int32, device=dev)
    if rows:
        vals = torch.empty(rows, _LIST, dtype=torch.float32, device=dev)
        ids = torch.empty(rows, _LIST, dtype=torch.int32, device=dev)
        logprobs_kernel[(rows,)](
            logits, chosen, chosen if index is None else index, out, vals, ids, logits.shape[1], logits.stride(0),
            num_top, TILE=_TILE, DEPTH=_DEPTH, LIST=_LIST, PIVOTS=16, INDEXED=index is not None, num_warps=16,
        )  # fmt: skip
    return out
