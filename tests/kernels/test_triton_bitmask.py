"""The Triton allowed-token bitmask kernel (in Triton's interpreter without CUDA) against a plain unpacking."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab,words,block", [(70, 3, 16), (100, 2, 32)])  # (100, 2): tokens 64+ kept
def test_triton_bitmask_matches_the_bits(dtype, vocab, words, block):
    from pagedllm.kernels.bitmask import apply_bitmask

    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(5, vocab, generator=g) * 3).to(dtype)
    masks = np.random.default_rng(vocab).integers(-(2**31), 2**31, size=(2, words)).astype(np.int32)
    rows = [3, 1]
    expected = logits.clone()
    for row, mask in zip(rows, masks):
        for t in range(min(vocab, 32 * words)):
            if not (int(mask[t // 32]) >> (t % 32)) & 1:
                expected[row, t] = float("-inf")
    x = logits.to(DEVICE)
    apply_bitmask(x, torch.tensor(rows, device=DEVICE), torch.from_numpy(masks).to(DEVICE), block=block)
    assert torch.equal(x.cpu(), expected)
