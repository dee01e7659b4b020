"""Repetition, presence and frequency penalties on the GPU in one launch over the penalized rows' token places,
without a sort or a host sync; every input travels in one host-to-device copy (pack_rows).

One program per row. An int32 table [rows, vocab] (not zeroed: the program first zeroes the entries its tokens
touch) holds per (row, token) twice its count among the outputs plus a claim bit. The program counts with atomic
adds of 2, then visits every token place again, and the one place of each token that sets the claim bit first (an
atomic or) penalizes that logit once, with the final count. Every token the row holds is seen (repetition), whether
in the prompt or the output."""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

_BLOCK = 512  # token places per iteration


_EXTRA = 6  # words after a row's tokens (pack_rows)


@triton.jit
def _places(rows_ptr, row, chunk, max_len, stride, BLOCK: tl.constexpr):
    """The tokens at one block of a row's places, whether each is held and whether it is an output. [BLOCK] each"""
    row_ptr = rows_ptr + row * stride  # the row's tokens, then its prompt length and its length (pack_rows)
    pos = chunk * BLOCK + tl.arange(0, BLOCK)
    num_prompt = tl.load(row_ptr + max_len)
    held = pos < tl.load(row_ptr + max_len + 1)
    token = tl.load(row_ptr + pos, mask=held, other=0)
    return token, held, held & (pos >= num_prompt)


@triton.jit
def penalize_kernel(
    logits_ptr,  # [batch, vocab] float32, changed in place
    rows_ptr,  # [n, max_len + 6] int64: pack_rows
    table_ptr,  # [n, vocab] int32 scratch: 2 x occurrences among the outputs, + 1 once claimed
    max_len,
    stride,  # rows_ptr's row stride (max_len + 6)
    vocab,
    stride_row,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    table_ptr += row.to(tl.int64) * vocab
    for chunk in range(0, tl.cdiv(max_len, BLOCK)):  # the entries this row touches start at 0
        token, held, _ = _places(rows_ptr, row, chunk, max_len, stride, BLOCK)
        tl.store(table_ptr + token, tl.zeros([BLOCK], tl.int32), mask=held)
    tl.debug_barrier()
    for chunk in range(0, tl.cdiv(max_len, BLOCK)):
        token, held, output = _places(rows_ptr, row, chunk, max_len, stride, BLOCK)
        tl.atomic_add(table_ptr + token, 2 * output.to(tl.int32), mask=held)
    tl.debug_barrier()
    extra = rows_ptr + row * stride + max_len + 2
    logits_ptr += tl.load(extra) * stride_row
    rep = tl.load(extra + 1).to(tl.int32).to(tl.float32, bitcast=True)
    presence = tl.load(extra + 2).to(tl.int32).to(tl.float32, bitcast=True)
    frequency = tl.load(extra + 3).to(tl.int32).to(tl.float32, bitcast=True)
    for chunk in range(0, tl.cdiv(max_len, BLOCK)):
        token, held, _ = _places(rows_ptr, row, chunk, max_len, stride, BLOCK)
        entry = tl.atomic_or(table_ptr + token, 1, mask=held)  # masked: unused
        go = held & ((entry & 1) == 0)  # one place of each token claims it
        count = (entry >> 1).to(tl.float32)
        x = tl.load(logits_ptr + token, mask=go, other=0.0)
        x = tl.where(x > 0, x / rep, x * rep)
        x -= frequency * count + tl.where(count > 0, presence, 0.0)
        tl.store(logits_ptr + token, x, mask=go)


def pack_rows(
    rows: np.ndarray,  # [n] the batch rows penalized
    token_ids: np.ndarray,  # [n, max_len] each row's prompt then output tokens
    num_prompt: np.ndarray,
    num_tokens: np.ndarray,  # [n] each
    repetition: np.ndarray,
    presence: np.ndarray,
    frequency: np.ndarray,  # [n] each
) -> np.ndarray:
    """Everything the kernel reads, one row per penalized row: its tokens, prompt length, length, batch row, then
    the float32 bits of its repetition, presence and frequency penalties. [n, max_len + 6] int64"""
    n, max_len = token_ids.shape
    packed = np.empty((n, max_len + _EXTRA), dtype=np.int64)
    packed[:, :max_len] = token_ids
    packed[:, max_len : max_len + 3] = np.stack([num_prompt, num_tokens, rows], axis=1)
    penalties = np.stack([repetition, presence, frequency], axis=1).astype(np.float32)
    packed[:, max_len + 3 :] = penalties.view(np.uint32)
    return packed


def apply_penalties(
    logits: torch.Tensor,  # [batch, vocab] float32, changed in place
    packed: torch.Tensor,  # [n, max_len + 6] int64 on the logits' device: pack_rows
) -> torch.Tensor:
    n, max_len = packed.shape[0], packed.shape[1] - _EXTRA
    vocab = logits.shape[1]
    table = torch.empty(n, vocab, dtype=torch.int32, device=logits.device)
    penalize_kernel[(n,)](logits, packed, table, max_len, packed.stride(0), vocab, logits.stride(0), BLOCK=_BLOCK)
    return logits
