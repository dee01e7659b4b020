"""Logprobs on the GPU in one launch: per row the log-sum-exp, the chosen token's logprob and rank, and the top-n
tokens with their logprobs, without a sort of the vocabulary or a host sync.

One pass keeps per lane a running max and sum of exp (the log-sum-exp), the count of tokens above the chosen one
(its rank) and the lane's max. At least n tokens reach the n-th largest lane max, so a second pass lists the tokens
at or above it (a few more than n) and the list is sorted in registers. Where that list would be too long (many
equal logits), the n-th largest value is searched for exactly (as the sampler's top-k) and the list holds the tokens
above it, then those equal to it. As in the sampler, NaN logits count as -inf and +inf as the largest float."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.sampling import _LOG2E, _gather, _key, _kth_largest, _search, _tokens

_TILE = 1024  # tokens per iteration
_LIST = 128  # top-n candidates sorted in registers


@triton.jit
def logprobs_kernel(
    logits_ptr,  # [rows, vocab] float32 / bfloat16 / float16, unit stride along the vocabulary
    chosen_ptr,  # [rows] int64: the token whose logprob and rank are wanted
    chosen_lp_ptr,  # [rows] float32 out
    ranks_ptr,  # [rows] int64 out: 1 = the most likely token
    top_ids_ptr,  # [rows, num_top] int64 out
    top_lp_ptr,  # [rows, num_top] float32 out
    vals_ptr,  # [rows, LIST] float32 scratch
    ids_ptr,  # [rows, LIST] int32 scratch
    vocab,
    stride_row,
    num_top,
    TILE: tl.constexpr,
    LIST: tl.constexpr,
    PIVOTS: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    lanes = tl.arange(0, TILE)
    chosen = tl.load(chosen_ptr + row)
    c = _tokens(row_ptr, chosen + tl.zeros([1], tl.int64), vocab, 1.0)  # [1]
    lane_top = tl.full([TILE], float("-inf"), tl.float32)
    lane_sum = tl.zeros([TILE], tl.float32)  # sum of exp(x - lane_top)
    above = tl.zeros([TILE], tl.int32)
    for start in range(0, vocab, TILE):
        s = _tokens(row_ptr, start + lanes, vocab, 1.0)
        new_top = tl.maximum(lane_top, s)
        safe = tl.where(new_top == float("-inf"), 0.0, new_top)  # no -inf - -inf
        lane_sum = lane_sum * tl.exp2((lane_top - safe) * _LOG2E) + tl.exp2((s - safe) * _LOG2E)
        lane_top = new_top
        above += (s > c).to(tl.int32)
    top = tl.max(lane_top, 0)
    safe_top = tl.where(top == float("-inf"), 0.0, top)
    lse = safe_top + tl.log(tl.sum(lane_sum * tl.exp2((lane_top - safe_top) * _LOG2E), 0))
    tl.store(chosen_lp_ptr + row, tl.sum(c, 0) - lse)
    tl.store(ranks_ptr + row, tl.sum(above, 0).to(tl.int64) + 1)
    if num_top > 0:
        vals, ids = vals_ptr + row * LIST, ids_ptr + row * LIST
        hi = _key(top).to(tl.int64) + 1
        lo = _kth_largest(lane_top, num_top, TILE)  # at least num_top tokens are at or above it
        count = _gather(row_ptr, vocab, 1.0, lo, hi, vals, ids, LIST, TILE)
        if count > LIST:  # many equal values: the num_top-th largest exactly, then the tokens above and at it
            lo = _search(row_ptr, vocab, 1.0, top, lo, hi, num_top, False, False, TILE, PIVOTS)
            count = _gather(row_ptr, vocab, 1.0, lo + 1, hi, vals, ids, LIST, TILE)
            ties = _gather(row_ptr, vocab, 1.0, lo, lo + 1, vals + count, ids + count, LIST - count, TILE)
            count = tl.minimum(count + ties, LIST)
        at = tl.arange(0, LIST)
        v = tl.load(vals + at, mask=at < count, other=float("-inf"))
        token = tl.load(ids + at, mask=at < count, other=0)
        # by value, then the lower token first: the key in the high half, the token reversed in the low half
        order = tl.sort((_key(v).to(tl.int64) << 32) | (0x7FFFFFFF - token).to(tl.int64), descending=True)
        token = (0x7FFFFFFF - (order & 0xFFFFFFFF)).to(tl.int64)
        v = tl.load(row_ptr + token).to(tl.float32)  # the sorted tokens' logits, read again
        v = tl.minimum(tl.where(v == v, v, float("-inf")), 3.4028234663852886e38)
        keep = at < num_top
        tl.store(top_ids_ptr + row * num_top + at, token, mask=keep)
        tl.store(top_lp_ptr + row * num_top + at, v - lse, mask=keep)


def logprobs(logits: torch.Tensor, chosen: torch.Tensor, num_top: int):
    """logits [rows, vocab], chosen [rows] int64, num_top >= 0 (at most _LIST) -> (chosen logprob [rows], rank
    [rows] int64, top ids [rows, num_top] int64, top logprobs [rows, num_top]), on the device; no host sync."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, dev = logits.shape[0], logits.device
    chosen_lp = torch.empty(rows, dtype=torch.float32, device=dev)
    ranks = torch.empty(rows, dtype=torch.int64, device=dev)
    top_ids = torch.empty(rows, num_top, dtype=torch.int64, device=dev)
    top_lp = torch.empty(rows, num_top, dtype=torch.float32, device=dev)
    vals = torch.empty(rows, _LIST, dtype=torch.float32, device=dev)
    ids = torch.empty(rows, _LIST, dtype=torch.int32, device=dev)
    if rows:
        logprobs_kernel[(rows,)](
            logits, chosen, chosen_lp, ranks, top_ids, top_lp, vals, ids, logits.shape[1], logits.stride(0), num_top,
            TILE=_TILE, LIST=_LIST, PIVOTS=16, num_warps=16,
        )  # fmt: skip
    return chosen_lp, ranks, top_ids, top_lp
