"""Integer weights packed into int32 words, as the weight-only checkpoint formats store them, and the one layout the
WNA16 method keeps after loading.

A word holds 32 / bits unsigned values (bits 4: 8 values, bits 8: 4), value i at bits [i * bits, (i + 1) * bits)
unless an `order` says which value sits at which position (AWQ). The kept layout ("K-packed"): qweight int32
[ceil(K / pack), N], the value of input feature k and output n in word k // pack, position k % pack; the weight is
w[k, n] = (q[k, n] - zero[g(k), n]) * scale[g(k), n] with g(k) the group of input feature k."""

from __future__ import annotations

import torch

SUPPORTED_BITS = (4, 8)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ: position i of a word holds value AWQ_ORDER[i] of its 8


def pack_factor(bits: int) -> int:
    return 32 // bits


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 words -> their unsigned values (int32), `dim` grown pack-fold: value j of word w lands at w * pack + j.
    `order[i]`: the value index at position i of a word (None: value i at position i)."""
    pack = pack_factor(bits)
    positions = torch.arange(pack, dtype=torch.int32, device=packed.device)
    if order is not None:  # position of value j: the inverse permutation of `order`
        positions = torch.argsort(torch.tensor(order, device=packed.device)).to(torch.int32)
    dim = dim % packed.dim()
    shape = [1] * (packed.dim() + 1)
    shape[dim + 1] = pack
    values = (packed.unsqueeze(dim + 1) >> (positions * bits).reshape(shape)) & ((1 << bits) - 1)
    sizes = list(packed.shape)
    sizes[dim] *= pack
    return values.reshape(sizes)


def pack_int32(values: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The inverse of unpack_int32: unsigned values (< 2**bits) -> int32 words along `dim` (zero-padded to a whole
    word)."""
    pack = pack_factor(bits)
    dim = dim % values.dim()
    values = values.to(torch.int64).movedim(dim, -1)
    pad = -values.shape[-1] % pack
    values = torch.nn.functional.pad(values, (0, pad)).reshape(*values.shape[:-1], -1, pack)  # [..., words, pack]
    if order is not None:
        values = values[..., list(order)]  # position i takes value order[i]
    shifts = torch.arange(pack, dtype=torch.int64, device=values.device) * bits
    words = (values << shifts).sum(-1)  # disjoint bits: the sum is the bitwise or
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)  # as signed 32-bit words
    return words.movedim(-1, dim).contiguous()


def groups_of(g_idx: torch.Tensor | None, k: int, group_size: int, device: torch.device) -> torch.Tensor:
    """The group of each input feature [K] (long): g_idx where the checkpoint gives one, else k // group_size."""
    if g_idx is not None:
        return g_idx.to(device=device, dtype=torch.long)
    return torch.arange(k, device=device) // group_size


def dequantize(
    q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, groups: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """q [K, N] unsigned ints, zeros and scales [num_groups, N], groups [K] -> the weight [N, K] in dtype (float32
    arithmetic, one rounding to dtype)."""
    w = (q.float() - zeros.float()[groups]) * scales.float()[groups]  # [K, N]
    return w.t().to(dtype).contiguous()


def sort_groups(groups: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """For an act-order g_idx: the input-feature permutation that makes the groups contiguous runs of group_size
    (feature perm[i] moves to i, groups then i // group_size), or None when no permutation does (groups of other
    sizes). The identity when the groups already are."""
    perm = torch.argsort(groups, stable=True)
    expected = torch.arange(groups.numel(), device=groups.device) // group_size
    return perm if torch.equal(groups[perm], expected) else None
