"""Allowed-token bitmasks: a row may be constrained to the tokens its mask allows (structured outputs fill them).

A mask is packed int32 [ceil(vocab / 32)]: bit j of word w allows token 32 * w + j (the layout xgrammar and
llguidance fill); tokens past 32 * words are left as they are. apply_bitmask sets every token a row's mask does not
allow to -inf, in place, before anything else reads the logits (so the logprobs are those of the masked logits, as
in vLLM, where the model runner applies the grammar bitmask to the logits it hands the sampler). A row with no mask
is untouched, and a step with none costs nothing. A row verifying k drafts has a mask per target position
(per_position): the grammar's allowed tokens after each draft."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from pagedllm.device import to_device
from pagedllm.kernels import cpu_sampling
from pagedllm.sample.impl import TRITON, C


class Bitmask(NamedTuple):
    """The masks of some rows of a step's logits, where the sampler's implementation reads them."""

    rows: torch.Tensor | np.ndarray  # [n] int64: the logits rows masked
    masks: torch.Tensor | np.ndarray  # [n, words] int32


def stack_bitmasks(masks: list[np.ndarray | None], impl: str, device: torch.device) -> Bitmask | None:
    """One mask (or None) per logits row -> the masked rows' masks in one array, uploaded (before the forward) where
    the implementation reads them on the device. None: no row has a mask."""
    rows = [i for i, m in enumerate(masks) if m is not None]
    if not rows:
        return None
    arrays = [np.asarray(masks[i]) for i in rows]
    for a in arrays:
        if a.ndim != 1 or a.dtype not in (np.int32, np.uint32):
            raise ValueError(f"grammar_bitmask: a mask is packed int32 [words], not {a.dtype} {list(a.shape)}")
    words = {len(a) for a in arrays}
    if len(words) != 1:
        raise ValueError(f"grammar_bitmask: the masks of one step must have the same number of words, not {words}")
    stacked = _rows_of_one_array(arrays)
    if stacked is None:
        stacked = np.stack([a.view(np.int32) for a in arrays])  # [n, words]
    index = np.array(rows, dtype=np.int64)
    if impl == C:
        return Bitmask(index, stacked)
    owner = stacked.base  # the filler's pinned buffer (structured_output/manager.py MaskBuffers): uploaded as it is
    if isinstance(owner, torch.Tensor) and device.type == "cuda" and owner.is_pinned():
        return Bitmask(to_device(index, device), torch.from_numpy(stacked).to(device, non_blocking=True))
    return Bitmask(to_device(index, device), to_device(stacked, device))


def _rows_of_one_array(arrays: list[np.ndarray]) -> np.ndarray | None:
    """The int32 array [n, words] whose rows the masks are, in order (as a step's filled masks usually are), so that
    they need no copy; None where they are not."""
    base = arrays[0].base
    if not (isinstance(base, np.ndarray) and base.ndim == 2 and len(base) == len(arrays) and base.dtype == np.int32):
        return None
    if not base.flags.c_contiguous or any(a.base is not base for a in arrays):
        return None
    start, stride = base.__array_interface__["data"][0], base.strides[0]
    for i, a in enumerate(arrays):
        if a.__array_interface__["data"][0] != start + i * stride:
            return None
    return base


def per_position(masks: list[np.ndarray | None], num_drafts: np.ndarray) -> list[np.ndarray | None]:
    """A step with drafts: per request its mask (None; [words] without drafts; [k + 1, words] with k drafts, row i
    for the target token after drafts[:i]) -> one mask (or None) per target position, in logits order."""
    out: list[np.ndarray | None] = []
    for mask, k in zip(masks, num_drafts.tolist()):
        if mask is None:
            out += [None] * (k + 1)
            continue
        mask = np.asarray(mask)
        if mask.ndim == 1 and k == 0:
            out.append(mask)
        elif mask.ndim == 2 and len(mask) == k + 1:
            out.extend(mask)
        else:
            raise ValueError(f"grammar_bitmask: a row verifying {k} drafts needs {k + 1} masks, not {list(mask.shape)}")
    return out


def apply_bitmask(logits: torch.Tensor, bitmask: Bitmask, impl: str) -> torch.Tensor:
    """Every token a masked row does not allow becomes -inf, in place. logits [batch, vocab]"""
    if impl == TRITON:
        from pagedllm.kernels.bitmask import apply_bitmask as triton_apply

        return triton_apply(logits, bitmask.rows, bitmask.masks)
    if impl == C and logits.dtype == torch.float32:
        return cpu_sampling.apply_bitmask(logits, bitmask.rows, bitmask.masks)
    rows, masks = (torch.as_tensor(t, device=logits.device) for t in bitmask)
    covered = min(logits.shape[1], 32 * masks.shape[1])
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((masks[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :covered]  # [n, 32 * words] -> [n, covered]
    part = logits[:, :covered]
    part.index_copy_(0, rows, part.index_select(0, rows).masked_fill_(~allowed, float("-inf")))
    return logits
