"""Repetition, presence and frequency penalties inside the GPU sampling kernel (pagedllm/kernels/sampling.py): a
penalized row's program copies the row to a work row and penalizes the copy there, over the row's token places,
without a sort; the logits themselves stay as they are (the logprobs read them). Every input travels in the
sampling kernel's one host-to-device copy (pack_rows).

An int32 table [vocab] per penalized row (not zeroed: the program first zeroes the entries its tokens touch) holds
per token twice its count among the outputs plus a claim bit. The program counts with atomic adds of 2, then visits
every token place again, and the one place of each token that sets the claim bit first (an atomic or) penalizes
that logit once, with the final count. Every token the row holds is seen (repetition), whether in the prompt or the
output."""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

EXTRA = tl.constexpr(5)  # words after a row's tokens (pack_rows)


@triton.jit
def _places(words_ptr, chunk, max_len, BLOCK: tl.constexpr):
    """The tokens at one block of a row's places, whether each is held and whether it is an output. [BLOCK] each"""
    pos = chunk * BLOCK + tl.arange(0, BLOCK)
    num_prompt = tl.load(words_ptr + max_len)
    held = pos < tl.load(words_ptr + max_len + 1)
    token = tl.load(words_ptr + pos, mask=held, other=0)
    return token, held, held & (pos >= num_prompt)


@triton.jit
def penalize_row(
    src_ptr,  # [vocab] the row's logits (read)
    dst_ptr,  # [vocab] its work row (written: the penalized copy)
    table_ptr,  # [vocab] int32 scratch: 2 x occurrences among the outputs, + 1 once claimed
    words_ptr,  # the row's packed words (pack_rows)
    max_len,
    vocab,
    TILE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """dst = src with the row's penalties applied: repetition (HF/CTRL: positive logits divided, negative multiplied)
    over every token it holds, then the OpenAI presence and frequency penalties over its outputs."""
    for start in range(0, vocab, TILE * 8):  # wide tiles: more loads in flight per round trip to memory
        idx = start + tl.arange(0, TILE * 8)
        tl.store(dst_ptr + idx, tl.load(src_ptr + idx, mask=idx < vocab), mask=idx < vocab)
    for chunk in range(0, tl.cdiv(max_len, BLOCK)):  # the entries this row touches start at 0
        token, held, _ = _places(words_ptr, chunk, max_len, BLOCK)
        tl.store(table_ptr + token, tl.zeros([BLOCK], tl.int32), mask=held)
    tl.debug_barrier()  # the copy and the zeroes are seen by every thread of the program
    for chunk in range(0, tl.cdiv(max_len, BLOCK)):
        token, held, output = _places(words_ptr, chunk, max_len, BLOCK)
        tl.atomic_add(table_ptr + token, 2 * output.to(tl.int32), mask=held)
    tl.debug_barrier()
    rep = tl.load(words_ptr + max_len + 2).to(tl.float32, bitcast=True)
    presence = tl.load(words_ptr + max_len + 3).to(tl.float32, bitcast=True)
    frequency = tl.load(words_ptr + max_len + 4).to(tl.float32, bitcast=True)
    for chunk in range(0, tl.cdiv(max_len, BLOCK)):
        token, held, _ = _places(words_ptr, chunk, max_len, BLOCK)
        entry = tl.atomic_or(table_ptr + token, 1, mask=held)  # masked: unused
        go = held & ((entry & 1) == 0)  # one place of each token claims it
        count = (entry >> 1).to(tl.float32)
        x = tl.load(dst_ptr + token, mask=go, other=0.0).to(tl.float32)
        x = tl.where(x > 0, x / rep, x * rep)
        x -= frequency * count + tl.where(count > 0, presence, 0.0)
        tl.store(dst_ptr + token, x, mask=go)
    tl.debug_barrier()  # the penalized row is read by every thread of the program


def pack_rows(
    token_ids: np.ndarray,  # [n, max_len] each row's prompt then output tokens
    num_prompt: np.ndarray,
    num_tokens: np.ndarray,  # [n] each
    repetition: np.ndarray,
    presence: np.ndarray,
    frequency: np.ndarray,  # [n] each
    out: np.ndarray | None = None,  # [n, max_len + EXTRA] int32 to write into
) -> np.ndarray:
    """Everything penalize_row reads, one row of words per penalized row: its tokens, prompt length and length, then
    the float32 bits of its repetition, presence and frequency penalties. [n, max_len + EXTRA] int32"""
    n, max_len = token_ids.shape
    packed = np.empty((n, max_len + EXTRA.value), dtype=np.int32) if out is None else out
    packed[:, :max_len] = token_ids
    packed[:, max_len] = num_prompt
    packed[:, max_len + 1] = num_tokens
    floats = packed.view(np.float32)
    floats[:, max_len + 2], floats[:, max_len + 3], floats[:, max_len + 4] = repetition, presence, frequency
    return packed
