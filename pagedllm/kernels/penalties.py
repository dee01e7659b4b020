"""Repetition, presence and frequency penalties on the GPU in two launches over the penalized rows' token places,
without a sort or a host sync.

One zeroed int32 table [rows, vocab] holds per (row, token) twice its count among the outputs plus a claim bit. The
first kernel counts with atomic adds of 2; the second visits every token place again, and the one place of each
(row, token) that sets the claim bit first (an atomic or) penalizes that logit once, with the final count. Every
token the rows hold is seen (repetition), whether in the prompt or the output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 256  # token places per program


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
def count_outputs_kernel(tokens_ptr, table_ptr, max_len, vocab, BLOCK: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    token, held, output = _places(tokens_ptr, row, chunk, max_len, BLOCK)
    tl.atomic_add(table_ptr + row.to(tl.int64) * vocab + token, 2 * output.to(tl.int32), mask=held)


@triton.jit
def penalize_kernel(
    logits_ptr,  # [batch, vocab] float32, changed in place
    rows_ptr,  # [n] int64: the batch row of each penalized row
    tokens_ptr,  # [n, max_len + 2] int64: each row's prompt then output tokens, its prompt length, its length
    table_ptr,  # [n, vocab] int32: 2 x occurrences among the outputs, + 1 once claimed
    repetition_ptr,
    presence_ptr,
    frequency_ptr,  # [n] float32 each
    max_len,
    vocab,
    stride_row,
    BLOCK: tl.constexpr,
):
    row, chunk = tl.program_id(0), tl.program_id(1)
    token, held, _ = _places(tokens_ptr, row, chunk, max_len, BLOCK)
    entry = tl.atomic_or(table_ptr + row.to(tl.int64) * vocab + token, 1, mask=held)  # masked: unused
    go = held & ((entry & 1) == 0)  # one place of each (row, token) claims it
    count = (entry >> 1).to(tl.float32)
    logit_ptr = logits_ptr + tl.load(rows_ptr + row) * stride_row + token
    x = tl.load(logit_ptr, mask=go, other=0.0)
    rep = tl.load(repetition_ptr + row)
    x = tl.where(x > 0, x / rep, x * rep)
    x -= tl.load(frequency_ptr + row) * count + tl.where(count > 0, tl.load(presence_ptr + row), 0.0)
    tl.store(logit_ptr, x, mask=go)


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
    table = torch.zeros(n, vocab, dtype=torch.int32, device=logits.device)
    grid = (n, triton.cdiv(max_len, _BLOCK))
    count_outputs_kernel[grid](tokens, table, max_len, vocab, BLOCK=_BLOCK)
    penalize_kernel[grid](
        logits, rows, tokens, table, repetition, presence, frequency, max_len, vocab, logits.stride(0), BLOCK=_BLOCK
    )
    return logits
