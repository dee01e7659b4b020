"""A row's argmax and largest values from the maxima of its tiles (TILE contiguous tokens), for the sampler's torch
path and the logprobs on the CPU.

torch's CPU argmax and topk over rows of tens of thousands of logits are several times slower than its max over
short contiguous runs, which vectorizes (runs of 64 or 128 floats do; 16, 24 or 48 do not). So one pass takes the
maxima of the tiles, and the rest reads a few tiles. Every token larger than the k-th largest maximum of the whole
tiles lies in one of the k whole tiles with the largest maxima, and those tiles hold at least k tokens that large
(their maxima): a row's k largest tokens are the k largest among those tiles' tokens and the tail (the tokens past
the last whole tile). NaN counts as the largest value, as in torch's argmax and topk."""

from __future__ import annotations

import numpy as np
import torch

TILE = 64


def tile_maxima(x: torch.Tensor) -> torch.Tensor:
    """The maximum of each tile of each row, the tail's last (NaN propagates). x [rows, vocab] -> [rows, tiles]"""
    whole = x.shape[1] // TILE * TILE
    maxima = x[:, :whole].unflatten(1, (-1, TILE)).amax(dim=-1)
    if whole == x.shape[1]:
        return maxima
    return torch.cat([maxima, x[:, whole:].amax(dim=-1, keepdim=True)], dim=1)


def _windows(x: torch.Tensor, rows: torch.Tensor | None, starts: torch.Tensor) -> torch.Tensor:
    """The TILE tokens from each of the given offsets of each row, read from x's memory (no copy of whole rows).
    x [batch, vocab], rows [n] (None: all), starts [n, m] offsets in the row -> [n, m * TILE]"""
    x = x.contiguous()
    rows = torch.arange(x.shape[0], device=x.device) if rows is None else rows
    windows = x.view(-1).unfold(0, TILE, 1)  # the TILE tokens from each offset: a view
    return windows.index_select(0, (rows[:, None] * x.shape[1] + starts).flatten()).view(len(starts), -1)


def _starts(tiles: torch.Tensor, vocab: int) -> torch.Tensor:
    """The offsets of the given whole tiles [n, k], then (if the vocabulary has a tail) of the window that ends with
    the row, whose last vocab % TILE tokens are the tail. [n, k or k + 1]"""
    starts = tiles * TILE
    if vocab % TILE:
        starts = torch.cat([starts, starts.new_full((len(starts), 1), vocab - TILE)], dim=1)
    return starts


def argmax(x: torch.Tensor, maxima: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """torch.argmax(x[rows], -1): each row's first largest token. maxima: tile_maxima(x[rows]). [n] int64"""
    whole = x.shape[1] // TILE
    if whole == 0:
        return (x if rows is None else x[rows]).argmax(dim=-1)
    # the first whole tile holding the maximum (the last one where only the tail does), then the tail's window: the
    # first largest among them is the row's (the window repeats the last tile's tokens only after their own place)
    starts = _starts(maxima.argmax(dim=-1, keepdim=True).clamp_(max=whole - 1), x.shape[1])
    at = _windows(x, rows, starts).argmax(dim=-1, keepdim=True)
    return (starts.gather(1, at // TILE) + at % TILE).squeeze(1)


def topk(
    x: torch.Tensor, k: int, maxima: torch.Tensor, rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(x[rows], k): values [n, k] descending and their ids [n, k] (equal values maybe in another order).
    maxima: tile_maxima(x[rows])."""
    whole = x.shape[1] // TILE
    if not 0 < k <= whole:
        return (x if rows is None else x[rows]).topk(k, dim=-1)
    bound, best = maxima[:, :whole].topk(k, dim=-1, sorted=False)
    starts = _starts(best, x.shape[1])
    vals = _windows(x, rows, starts)
    # the k largest are among the tokens not below the least of those maxima (NaN stays), usually a few more than k
    keep = _not_below(vals, bound.amin(dim=-1, keepdim=True))
    keep[:, k * TILE : (k + 1) * TILE - x.shape[1] % TILE] = False  # the tail's window: the last tile's tokens
    packed, col = pack(vals, keep, float("-inf"))  # (a row with fewer kept than others has k of them above -inf)
    ids = starts.gather(1, col // TILE) + col % TILE
    vals, at = packed.topk(k, dim=-1, sorted=False)
    vals, order = vals.sort(dim=-1, descending=True)  # cheaper than topk's own sort
    return vals, ids.gather(1, at.gather(1, order))


def _not_below(vals: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """vals >= bound [n, 1], NaN too. [n, m] bool"""
    if vals.is_cuda:
        return ~(vals < bound)
    return torch.from_numpy(~(vals.numpy() < bound.numpy()))  # numpy's comparison into bools is several times faster


def pack(vals: torch.Tensor, keep: torch.Tensor, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's kept values moved to its left in order, in rows as wide as the most kept (at least 1), the rest
    `fill`; and the column each came from (0 where filled). vals, keep [n, m] -> ([n, width], [n, width])"""
    if keep.is_cuda:
        flat = keep.view(-1).nonzero().squeeze(1)
    else:  # numpy's nonzero is several times faster than torch's on the CPU
        flat = torch.from_numpy(np.flatnonzero(keep.numpy()))
    row, col = flat // keep.shape[1], flat % keep.shape[1]
    count = torch.bincount(row, minlength=len(vals))
    place = torch.arange(len(row), device=vals.device) - (count.cumsum(0) - count)[row]
    width = max(int(count.max()), 1)
    packed = vals.new_full((len(vals), width), fill).index_put_((row, place), vals[row, col])
    return packed, col.new_zeros((len(vals), width)).index_put_((row, place), col)
