"""Per-request logit adjustments applied before sampling: allowed tokens, logit bias, banned tokens, and the
repetition / presence / frequency penalties, each vectorized over the rows that use it."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.device import to_device


def apply_penalties(
    logits: torch.Tensor,  # [batch, vocab], changed in place
    rows: torch.Tensor,  # [n] the batch rows the next arguments describe
    token_ids: np.ndarray,  # [n, max_len] int64: each row's prompt then output tokens
    num_prompt: np.ndarray,  # [n]
    num_tokens: np.ndarray,  # [n]
    repetition: torch.Tensor,  # [n]
    presence: torch.Tensor,  # [n]
    frequency: torch.Tensor,  # [n]
) -> torch.Tensor:
    """Repetition penalty (HF/CTRL: divide positive, multiply negative logits of tokens seen in the prompt or the
    output), then the OpenAI presence and frequency penalties over the output tokens.

    Only the tokens that occur are touched: one sorted pass over the (row, token) pairs, none over the vocabulary."""
    n, max_len = token_ids.shape
    vocab = logits.shape[1]
    position = np.arange(max_len)[None, :]
    present = position < num_tokens[:, None]  # [n, max_len]
    row_of = np.broadcast_to(np.arange(n)[:, None], token_ids.shape)[present]
    keys = to_device(row_of * vocab + token_ids[present], logits.device)  # one per (row, token) pair
    is_output = to_device((position >= num_prompt[:, None])[present], logits.device)
    seen, inverse = torch.unique(keys, return_inverse=True)  # the distinct (row, token) pairs
    count = torch.zeros(len(seen), dtype=logits.dtype, device=logits.device)
    count.index_add_(0, inverse, is_output.to(logits.dtype))  # occurrences among the outputs
    local, token = seen // vocab, seen % vocab
    row = rows.to(logits.device)[local]
    values = logits[row, token]
    rep = repetition[local]
    values = torch.where(values > 0, values / rep, values * rep)
    values = values - frequency[local] * count - presence[local] * (count > 0).to(values.dtype)
    logits[row, token] = values
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
