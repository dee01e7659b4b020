"""The sliced GPU argmax (in Triton's interpreter without CUDA) against torch.argmax: the first largest token, ties
across and within slices, NaN, +inf and -inf rows, bfloat16 and float32, strided rows."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(1, 9000), (5, 4096), (3, 5000), (2, 17)])
def test_argmax_rows_equals_torch(dtype, rows, vocab):
    from pagedllm.kernels.argmax import TILE, argmax_rows

    g = torch.Generator().manual_seed(rows * vocab)
    x = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    if vocab > TILE:  # the largest value twice, in two slices: the first wins
        x[0, TILE + 3] = x[0, vocab - 1] = 100.0
        x[-1, 7] = x[-1, TILE + 1] = 200.0
    x[-1, vocab // 2] = x[-1].max()  # a tie within a slice
    got = argmax_rows(x.to(DEVICE)).cpu()
    assert got.dtype == torch.int64
    assert torch.equal(got, x.argmax(dim=-1))


def test_argmax_rows_special_values_and_strides():
    from pagedllm.kernels.argmax import argmax_rows

    x = torch.randn(4, 6000)
    x[0, :] = float("-inf")  # all -inf: token 0, as torch
    x[1, 4500] = float("inf")
    x[2, 5100] = float("nan")  # NaN counts as the largest
    x[3, 10] = float("inf")
    x[3, 4200] = float("inf")
    wide = torch.zeros(4, 6100)
    wide[:, :6000] = x
    view = wide[:, :6000]  # rows 6100 apart
    got = argmax_rows(view.to(DEVICE)).cpu()
    assert torch.equal(got, x.argmax(dim=-1))
    assert got.tolist() == [0, 4500, 5100, 10]
