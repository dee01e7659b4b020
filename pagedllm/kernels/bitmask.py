"""Allowed-token bitmasks on the GPU: every token a row's mask does not allow becomes -inf, in place, before any
sampling rule reads the logits. A mask is packed int32 [words] (bit t % 32 of word t / 32 allows token t, the layout
xgrammar and llguidance fill); tokens past 32 * words are kept."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _apply_bitmask(logits_ptr, stride, rows_ptr, masks_ptr, words, vocab, BLOCK: tl.constexpr):
    j = tl.program_id(0)
    row = tl.load(rows_ptr + j).to(tl.int64)
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = t < tl.minimum(vocab, words * 32)
    word = tl.load(masks_ptr + j * words + (t >> 5), mask=inside, other=-1)
    allowed = ((word >> (t & 31)) & 1) != 0
    neg = tl.full((BLOCK,), float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride + t, neg, mask=inside & ~allowed)


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, masks: torch.Tensor, block: int = _BLOCK) -> torch.Tensor:
    """logits [batch, vocab] (changed in place), rows [n] int64 the rows masked, masks [n, words] int32."""
    assert logits.stride(-1) == 1 and masks.is_contiguous()
    n, words = masks.shape
    covered = min(logits.shape[1], 32 * words)
    if n and covered:
        _apply_bitmask[(n, triton.cdiv(covered, block))](
            logits, logits.stride(0), rows, masks, words, logits.shape[1], BLOCK=block
        )  # fmt: skip
    return logits
