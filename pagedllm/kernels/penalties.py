"""Repetition, presence and frequency penalties on the GPU in one launch over the penalized rows' token places,
without a sort or a host sync.

One program per row. An int32 table [rows, vocab] (not zeroed: the program first zeroes the entries its tokens
touch) holds per (row, token) twice its count among the outputs plus a claim bit. The program counts with atomic
adds of 2, then visits every token place again, and the one place of each token that sets the claim bit first (an
atomic or) penalizes that logit once, with the final count. Every token the row holds is seen (repetition), whether
in the prompt or the output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 512  # token places per iteration


@triton.jit
def _places(tokens_ptr, row, chunk, max_len, BLOCK: tl.constexpr):
    """The tokens at one block of a row's places, whether each is held and whether it is an output. [BLOCK] each"""
    row_ptr = tokens_ptr + row * (max_len + 2)  # the row's tokens, then its prompt length and its length
    pos = chunk * BLOCK + tl.arange(0, BLOCK)
    num_prompt = tl.load(row_ptr + max_len)
    held = pos < tl.load(row_ptr + max_len + 1)
    token = tl.load(row_ptr + pos, mask=held, other=0)
    return token, held, held & (pos >= num_prompt)


@triton.jit
def penalize_kernel(
    logits_ptr,  # [batch, vocab] float32, changed in place
    rows_ptr,  # [n] int64: the batch row of each penalized row
    tokens_ptr,  # [n, max_len + 2] int64: each row's prompt then output tokens, its prompt length, its length
    table_ptr,  # [n, vocab] int32 scratch: 2 x occurrences among the outputs, + 1 once claimed
    repetition_ptr,
    presence_ptr,
    frequency_ptr,  # [n] float32 each
    max_len,
    vocab,
    stride_row,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    table_ptr += row.to(tl.int64) * vocab
    for chunk in range(0, tl.cdiv(max_len, BLOCK)):  # the entries this row touches start at 0
        token, held, _ = _places(tokens_ptr, row, chunk, max_len, BLOCK)
        tl.store(table_ptr + token, tl.zeros([BLOCK], tl.int32), mask=held)
    tl.debug_barrier()
    for chunk in range(0, tl.cdiv(max_len, BLOCK)):
        token, held, output = _places(tokens_ptr, row, chunk, max_len, BLOCK)
        tl.atomic_add(table_ptr + token, 2 * output.to(tl.int32), mask=held)
    tl.debug_barrier()
    logits_ptr += tl.load(rows_ptr + row) * stride_row
    rep = tl.load(repetition_ptr + row)
    presence = tl.load(presence_ptr + row)
    frequency = tl.load(frequency_ptr + row)
    for chunk in range(0, tl.cdiv(max_len, BLOCK)):
        token, held, _ = _places(tokens_ptr, row, chunk, max_len, BLOCK)
        entry = tl.atomic_or(table_ptr + token, 1, mask=held)  # masked: unused
        go = held & ((entry & 1) == 0)  # one place of each token claims it
        count = (entry >> 1).to(tl.float32)
        x = tl.load(logits_ptr + token, mask=go, other=0.0)
        x = tl.where(x > 0, x / rep, x * rep)
        x -= frequency * count + tl.where(count > 0, presence, 0.0)
        tl.store(logits_ptr + token, x, mask=go)


def apply_penalties(
    logits: torch.Tensor,  # [batch, vocab] float32, changed in place
    rows: torch.Tensor,  # [n] int64
    tokens: torch.Tensor,  # [n, max_len + 2] int64: each row's tokens (prompt, then output), prompt length, length
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,  # [n] float32 each
) -> torch.Tensor:
    n, max_len = tokens.shape[0], tokens.shape[1] - 2
    vocab = logits.shape[1]
    table = torch.empty(n, vocab, dtype=torch.int32, device=logits.device)
    penalize_kernel[(n,)](
        logits, rows, tokens, table, repetition, presence, frequency, max_len, vocab, logits.stride(0), BLOCK=_BLOCK
    )
    return logits
