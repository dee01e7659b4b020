"""Per-request logit adjustments applied before sampling: allowed tokens, logit bias, banned tokens, and the
repetition / presence / frequency penalties, each vectorized over the rows that use it."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from pagedllm.device import to_device
from pagedllm.kernels import cpu_sampling
from pagedllm.sample.impl import C


class Penalties(NamedTuple):
    """The penalties of some rows of a batch, as apply_penalties takes them."""

    rows: np.ndarray  # [n] the batch rows penalized
    token_ids: np.ndarray  # [n, max_len] int64: each row's prompt then output tokens
    num_prompt: np.ndarray  # [n]
    num_tokens: np.ndarray  # [n]
    repetition: np.ndarray  # [n] float32
    presence: np.ndarray  # [n] float32
    frequency: np.ndarray  # [n] float32


def apply_penalties(
    logits: torch.Tensor,  # [batch, vocab], changed in place
    rows: np.ndarray,  # [n] the batch rows the next arguments describe
    token_ids: np.ndarray,  # [n, max_len] int64: each row's prompt then output tokens
    num_prompt: np.ndarray,  # [n]
    num_tokens: np.ndarray,  # [n]
    repetition: np.ndarray,  # [n] float32
    presence: np.ndarray,  # [n] float32
    frequency: np.ndarray,  # [n] float32
    scratch: cpu_sampling.Scratch | None = None,  # the C kernels' memory (their count table)
    impl: str | None = None,  # the sampler's implementation (None: the C kernels where they take the logits)
) -> torch.Tensor:
    """Repetition penalty (HF/CTRL: divide positive, multiply negative logits of tokens seen in the prompt or the
    output), then the OpenAI presence and frequency penalties over the output tokens.

    Only the tokens that occur are touched: on the CPU by one C call (a row at a time per thread); elsewhere the
    (row, token) pairs are told apart on the host (a sort of each row's tokens), then one gather and one scatter over
    the flat logits (contiguous), none over the vocabulary. (On a GPU with Triton the sampling kernel applies them to
    copies of the rows instead: pagedllm/kernels/penalties.py.)"""
    n, max_len = token_ids.shape
    vocab = logits.shape[1]
    if not n * max_len:
        return logits
    in_c = cpu_sampling.available(logits) if impl is None else impl == C and logits.dtype == torch.float32
    if in_c and logits.stride(-1) == 1:  # one C call over the rows' tokens
        return cpu_sampling.apply_penalties(
            logits, rows, token_ids, num_prompt, num_tokens, repetition, presence, frequency, scratch
        )  # fmt: skip
    position = np.arange(max_len)[None, :]
    present = position < num_tokens[:, None]  # [n, max_len]
    is_output = present & (position >= num_prompt[:, None])
    # each row's tokens in order with the output flag as the low bit, absent places last (past any token)
    key = np.sort(np.where(present, token_ids * 2 + is_output, 2 * vocab), axis=1).ravel()
    token = key >> 1
    starts = np.ones(len(key), dtype=bool)
    starts[1:] = token[1:] != token[:-1]
    starts[::max_len] = True  # every row starts anew
    first = np.flatnonzero(starts & (token < vocab))  # the first place of each distinct (row, token) pair
    outputs = np.cumsum(key & 1)
    last = np.append(first[1:], len(key)) - 1  # (the places up to the next pair: the same token, or absent)
    count = outputs[last] - outputs[first] + (key[first] & 1)  # occurrences among the outputs
    device = logits.device
    local = to_device(first // max_len, device)
    of_row = lambda per_row: to_device(per_row, device).index_select(0, local)  # noqa: E731 (faster than [])
    flat = of_row(np.asarray(rows, dtype=np.int64) * vocab) + to_device(token[first], device)  # flat places
    count = to_device(count, device).to(logits.dtype)
    values = logits.view(-1).index_select(0, flat)
    rep, presence, frequency = (of_row(np.asarray(v, dtype=np.float32)) for v in (repetition, presence, frequency))
    values = torch.where(values > 0, values / rep, values * rep)
    values = values - frequency * count - presence * (count > 0).to(values.dtype)
    logits.view(-1).index_copy_(0, flat, values.to(logits.dtype))
    return logits


def apply_token_constraints(
    logits: torch.Tensor,  # [rows, vocab]
    allowed: dict[int, list[int]],  # row -> the only tokens it may sample
    bias: dict[int, dict[int, float]],  # row -> token -> additive bias
    banned: dict[int, list[int]],  # row -> tokens it may not sample
) -> torch.Tensor:
    if allowed:
        rows = list(allowed)
        keep = np.zeros((len(rows), logits.shape[1]), dtype=bool)  # [len(allowed), vocab]
        for i, row in enumerate(rows):
            keep[i, allowed[row]] = True
        keep = to_device(keep, logits.device)
        index = to_device(np.array(rows), logits.device)
        logits[index] = logits[index].masked_fill(~keep, float("-inf"))
    pairs = [(row, tok, val) for row, b in bias.items() for tok, val in b.items()]
    if pairs:
        rows, toks, vals = zip(*pairs)
        dev = logits.device
        logits.index_put_(
            (to_device(np.array(rows), dev), to_device(np.array(toks), dev)),
            to_device(np.array(vals, dtype=np.float32), dev).to(logits.dtype),
            accumulate=True,
        )
    pairs = [(row, tok) for row, toks in banned.items() for tok in toks]
    if pairs:
        index = to_device(np.array(pairs), logits.device)
        logits[index[:, 0], index[:, 1]] = float("-inf")
    return logits
