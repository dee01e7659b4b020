"""Repetition, presence and frequency penalties inside the GPU sampling kernel (pagedllm/kernels/sampling.py): a
penalized row's program copies the row to a work row and penalizes the copy there, over the row's token places,
without a sort; the logits themselves stay as they are (the logprobs read them). The row's tokens and penalties live
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
    chunks = tl.cdiv(num_tokens, BLOCK)
    for chunk in range(0, chunks):  # the entries this row touches start at 0
        token, held, _ = _places(tokens_ptr, chunk, num_prompt, num_tokens, BLOCK)
        tl.store(table_ptr + token, tl.zeros([BLOCK], tl.int32), mask=held)
    tl.debug_barrier()  # the copy and the zeroes are seen by every thread of the program
    for chunk in range(0, chunks):
        token, held, output = _places(tokens_ptr, chunk, num_prompt, num_tokens, BLOCK)
        tl.atomic_add(table_ptr + token, 2 * output.to(tl.int32), mask=held)
    tl.debug_barrier()
    for chunk in range(0, chunks):
        token, held, _ = _places(tokens_ptr, chunk, num_prompt, num_tokens, BLOCK)
        entry = tl.atomic_or(table_ptr + token, 1, mask=held)  # masked: unused
        go = held & ((entry & 1) == 0)  # one place of each token claims it
        count = (entry >> 1).to(tl.float32)
        x = tl.load(dst_ptr + token, mask=go, other=0.0).to(tl.float32)
        x = tl.where(x > 0, x / rep, x * rep)
        x -= frequency * count + tl.where(count > 0, presence, 0.0)
        tl.store(dst_ptr + token, x, mask=go)
    tl.debug_barrier()  # the penalized row is read by every thread of the program
