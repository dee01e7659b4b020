"""Repetition, presence and frequency penalties inside the GPU sampling kernel (pagedllm/kernels/sampling.py): a
penalized row's program penalizes the row at its token places, without a sort: in place (the logits it changes saved
first, and put back once the row is sampled) where no other program reads the row, else (the row wants logprobs,
which read the logits as they are) in a copy of the row. The row's tokens and penalties live
in the kernel's state on the device (pagedllm/kernels/sampling_inputs.py), where the kernel appends each token it
samples: the tokens travel to the device once per request, not once per step.

An int32 table [vocab] per penalized row (not zeroed: the program first zeroes the entries its tokens touch) holds
per token twice its count among the outputs plus a claim bit. The program counts with atomic adds of 2, then visits
every token place again, and the one place of each token that sets the claim bit first (an atomic or) penalizes
that logit once, with the final count. Every token the row holds is seen (repetition), whether in the prompt or the
output."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _places(tokens_ptr, chunk, num_prompt, num_tokens, BLOCK: tl.constexpr):
    """The tokens at one block of a row's places, whether each is held and whether it is an output. [BLOCK] each"""
    pos = chunk * BLOCK + tl.arange(0, BLOCK)
    held = pos < num_tokens
    token = tl.load(tokens_ptr + pos, mask=held, other=0)
    return token, held, held & (pos >= num_prompt)


@triton.jit
def penalize_row(
    src_ptr,  # [vocab] the row's logits (read)
    dst_ptr,  # [vocab] its work row (written: the penalized copy)
    table_ptr,  # [vocab] int32 scratch: 2 x occurrences among the outputs, + 1 once claimed
    tokens_ptr,  # [num_tokens] int32: the row's prompt then output tokens
    num_prompt,
    num_tokens,
    rep,
    presence,
    frequency,  # float32 each
    vocab,
    TILE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """dst = src with the row's penalties applied: repetition (HF/CTRL: positive logits divided, negative multiplied)
    over every token it holds, then the OpenAI presence and frequency penalties over its outputs."""
    for start in range(0, vocab, TILE * 8):  # wide tiles: more loads in flight per round trip to memory
        idx = start + tl.arange(0, TILE * 8)
        tl.store(dst_ptr + idx, tl.load(src_ptr + idx, mask=idx < vocab), mask=idx < vocab)
    _penalize(dst_ptr, dst_ptr, table_ptr, tokens_ptr, num_prompt, num_tokens, rep, presence, frequency, False, BLOCK)


@triton.jit
def penalize_in_place(
    row_ptr,  # [vocab] the row's logits (penalized in place)
    saved_ptr,  # [vocab] written at the row's tokens: their logits as they were (for restore_row)
    table_ptr,
    tokens_ptr,
    num_prompt,
    num_tokens,
    rep,
    presence,
    frequency,
    BLOCK: tl.constexpr,
):
    """penalize_row without the copy: the row itself takes its penalties, at its tokens alone, and their logits as
    they were go to saved, from where restore_row puts them back. For a row that no other program reads."""
    _penalize(row_ptr, saved_ptr, table_ptr, tokens_ptr, num_prompt, num_tokens, rep, presence, frequency, True, BLOCK)


@triton.jit
def restore_row(row_ptr, saved_ptr, tokens_ptr, num_tokens, BLOCK: tl.constexpr):
    """The logits penalize_in_place changed, as they were."""
    tl.debug_barrier()  # every thread of the program has read the penalized row
    for chunk in range(0, tl.cdiv(num_tokens, BLOCK)):
        token, held, _ = _places(tokens_ptr, chunk, 0, num_tokens, BLOCK)
        tl.store(row_ptr + token, tl.load(saved_ptr + token, mask=held), mask=held)


@triton.jit
def _penalize(
    row_ptr, saved_ptr, table_ptr, tokens_ptr, num_prompt, num_tokens, rep, presence, frequency, SAVE: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Each token the row holds, penalized once in row (SAVE: its logit as it was to saved first)."""
    chunks = tl.cdiv(num_tokens, BLOCK)
    for chunk in range(0, chunks):  # the entries this row touches start at 0
        token, held, _ = _places(tokens_ptr, chunk, num_prompt, num_tokens, BLOCK)
        tl.store(table_ptr + token, tl.zeros([BLOCK], tl.int32), mask=held)
    tl.debug_barrier()  # the zeroes (and a copy of the row) are seen by every thread of the program
    for chunk in range(0, chunks):
        token, held, output = _places(tokens_ptr, chunk, num_prompt, num_tokens, BLOCK)
        tl.atomic_add(table_ptr + token, 2 * output.to(tl.int32), mask=held)
    tl.debug_barrier()
    for chunk in range(0, chunks):
        token, held, _ = _places(tokens_ptr, chunk, num_prompt, num_tokens, BLOCK)
        entry = tl.atomic_or(table_ptr + token, 1, mask=held)  # masked: unused
        go = held & ((entry & 1) == 0)  # one place of each token claims it
        count = (entry >> 1).to(tl.float32)
        x = tl.load(row_ptr + token, mask=go, other=0.0)
        if SAVE:
            tl.store(saved_ptr + token, x, mask=go)
        x = x.to(tl.float32)
        x = tl.where(x > 0, x / rep, x * rep)
        x -= frequency * count + tl.where(count > 0, presence, 0.0)
        tl.store(row_ptr + token, x, mask=go)
    tl.debug_barrier()  # the penalized row is read by every thread of the program
