"""Allowed-token bitmasks on the CPU paths (C kernels and torch ops) against a plain unpacking of the bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.sample.bitmask import apply_bitmask, per_position, stack_bitmasks
from pagedllm.sample.impl import choose_impl


def reference(logits: torch.Tensor, rows: list[int], masks: np.ndarray) -> torch.Tensor:
    """Token t of a masked row stays where bit t % 32 of word t // 32 is set (or t is past the mask), else -inf."""
    out = logits.clone()
    for row, mask in zip(rows, masks):
        for t in range(min(logits.shape[1], 32 * len(mask))):
            if not (int(mask[t // 32]) >> (t % 32)) & 1:
                out[row, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab,words", [(70, 3), (64, 2), (100, 2), (5, 1)])  # short masks keep the tail
def test_apply_bitmask_matches_the_bits(sampling_path, vocab, words):
    impl = choose_impl("cpu")
    assert impl == ("torch" if sampling_path == "torch" else "c")
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=g)
    rng = np.random.default_rng(vocab)
    masks = rng.integers(-(2**31), 2**31, size=(3, words)).astype(np.int32)
    masks[1] = -1  # every bit set: the row is untouched
    per_row = [masks[0], None, masks[1], None, masks[2], None]  # rows 1, 3, 5 have none
    expected = reference(logits, [0, 2, 4], masks)
    bitmask = stack_bitmasks(per_row, impl, torch.device("cpu"))
    out = apply_bitmask(logits, bitmask, impl)
    assert out is logits  # in place
    assert torch.equal(logits, expected)


def test_no_mask_is_no_bitmask():
    assert stack_bitmasks([None, None], "c", torch.device("cpu")) is None


def test_masks_of_different_widths_or_other_dtypes_are_refused():
    with pytest.raises(ValueError, match="same number of words"):
        stack_bitmasks([np.zeros(2, np.int32), np.zeros(3, np.int32)], "torch", torch.device("cpu"))
    with pytest.raises(ValueError, match="packed int32"):
        stack_bitmasks([np.zeros(2, np.int64)], "torch", torch.device("cpu"))


def test_per_position_masks_of_rows_with_drafts():
    """A row verifying k drafts has k + 1 masks, one per target position, in order; unmasked rows have none."""
    a = np.arange(6, dtype=np.int32).reshape(3, 2)  # a row with 2 drafts: masks after 0, 1, 2 of them
    b = np.array([7, 8], np.int32)  # a row without drafts
    out = per_position([a, None, b], np.array([2, 1, 0]))
    assert [None if m is None else m.tolist() for m in out] == [[0, 1], [2, 3], [4, 5], None, None, [7, 8]]
    with pytest.raises(ValueError, match="verifying 2 drafts needs 3 masks"):
        per_position([b], np.array([2]))  # one mask for three positions: refused, never repeated
    with pytest.raises(ValueError, match="verifying 1 drafts needs 2 masks"):
        per_position([a], np.array([1]))


def test_masks_that_are_the_rows_of_one_array_are_not_copied():
    """A step's filled masks are the rows of one array: stacked, they are that array; rows out of order, of part
    of it, or of several arrays are copied, and every case gives the same masks."""
    filled = np.arange(12, dtype=np.int32).reshape(4, 3).copy()  # owns its memory, as fill_bitmasks' array
    cases = {
        "in order": [filled[0], filled[1], filled[2], filled[3]],
        "swapped": [filled[1], filled[0], filled[2], filled[3]],
        "part": [filled[0], filled[1], filled[2]],
        "two arrays": [filled[0], filled[1], filled[2], filled.copy()[3]],
    }
    for name, masks in cases.items():
        stacked = stack_bitmasks(masks, "c", torch.device("cpu")).masks
        assert np.array_equal(stacked, np.stack(masks)), name
        assert np.shares_memory(stacked, filled) == (name == "in order"), name


def test_masks_filled_into_reused_buffers_are_the_rows_of_one_array():
    """The filler's buffers (MaskBuffers, taken in turn): a step's masks are the rows of the buffer taken, so they
    are stacked without a copy; buffers come back after NUM_BUFFERS steps, grown for more rows or other widths."""
    from pagedllm.structured_output.manager import MaskBuffers

    buffers = MaskBuffers(pinned=False)
    taken = [buffers.take(5, 3) for _ in range(MaskBuffers.NUM_BUFFERS + 1)]
    assert np.shares_memory(taken[0], taken[-1]) and not np.shares_memory(taken[0], taken[1])
    array = buffers.take(4, 3)
    array[:] = np.arange(12, dtype=np.int32).reshape(4, 3)
    stacked = stack_bitmasks([array[i] for i in range(4)], "c", torch.device("cpu")).masks
    assert np.shares_memory(stacked, array) and np.array_equal(stacked, array)
    assert buffers.take(200, 3).shape == (200, 3) and buffers.take(2, 7).shape == (2, 7)
