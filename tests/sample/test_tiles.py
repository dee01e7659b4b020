"""Argmax and top-k through the maxima of tiles against torch's own, over ties, a vocabulary with a tail (not a
multiple of the tile), banned (-inf), +inf and NaN tokens, subsets of rows, and vocabularies too small for tiles."""

from __future__ import annotations

import pytest
import torch

from pagedllm.sample import tiles

NAN, INF = float("nan"), float("inf")


def _rows(vocab: int, seed: int = 0) -> torch.Tensor:
    """Small integers (many ties within and across tiles) with the special rows of the sampler's inputs."""
    x = torch.randint(-6, 6, (40, vocab), generator=torch.Generator().manual_seed(seed)).float()
    x[0] = -INF  # every token banned
    x[1, -1] = 100.0  # the maximum in the tail
    x[2, [3, -2]] = NAN  # NaN counts as the largest, the first one wins
    x[3, -3] = NAN
    x[4, [5, -1]] = INF
    x[5, : vocab // 2] = -INF  # fewer finite tokens than some k
    x[5, vocab // 2 + 1 :] = -INF
    x[6] = 1.0  # one tie across the whole row
    return x


def _same_values(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.equal(ours.isnan(), ref.isnan())
    assert torch.equal(ours.nan_to_num(), ref.nan_to_num())


@pytest.mark.parametrize("vocab", [7, 64, 100, 4096, 4100, 20000])
def test_argmax_is_torchs_first_maximum(vocab):
    x = _rows(vocab)
    assert torch.equal(tiles.argmax(x, tiles.tile_maxima(x)), x.argmax(dim=-1))
    rows = torch.tensor([6, 4, 0, 9, 2, 1])
    assert torch.equal(tiles.argmax(x, tiles.tile_maxima(x[rows]), rows), x[rows].argmax(dim=-1))


@pytest.mark.parametrize("vocab", [100, 4100, 20000, 49152])
@pytest.mark.parametrize("k", [0, 1, 5, 50, 256])
def test_topk_values_are_torchs(vocab, k):
    k = min(k, vocab)  # more than the tiles: torch's topk
    x = _rows(vocab, seed=1)
    x[10:] = torch.randn(30, vocab, generator=torch.Generator().manual_seed(2)) * 3  # distinct values too
    for rows in (None, torch.tensor([12, 0, 5, 2, 6, 39])):
        sub = x if rows is None else x[rows]
        vals, ids = tiles.topk(x, k, tiles.tile_maxima(sub), rows)
        _same_values(vals, sub.topk(k, dim=-1).values)
        _same_values(sub.gather(1, ids), vals)  # each id holds its value
        assert (ids.sort(dim=-1).values.diff(dim=-1) > 0).all()  # no token twice
        assert ((ids >= 0) & (ids < vocab)).all()


def test_pack_keeps_the_order_of_each_rows_kept_values():
    vals = torch.arange(12.0).view(3, 4)
    keep = torch.tensor([[True, False, True, True], [False] * 4, [False, True, False, False]])
    packed, col = tiles.pack(vals, keep, -1.0)
    assert torch.equal(packed, torch.tensor([[0.0, 2.0, 3.0], [-1.0, -1.0, -1.0], [9.0, -1.0, -1.0]]))
    assert torch.equal(col, torch.tensor([[0, 2, 3], [0, 0, 0], [1, 0, 0]]))
