"""Per-request logit adjustments applied before sampling: allowed tokens, logit bias, banned tokens, and the
repetition / presence / frequency penalties. Each is one vectorized pass over the rows that use it."""

from __future__ import annotations

import torch


def token_counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] float32: how often each token occurs in each row's list."""
    longest = max((len(t) for t in token_lists), default=0)
    index = torch.full((len(token_lists), max(longest, 1)), vocab_size, dtype=torch.int64)  # pad: an extra column
    for i, tokens in enumerate(token_lists):
        index[i, : len(tokens)] = torch.as_tensor(tokens, dtype=torch.int64)
    counts = torch.zeros(len(token_lists), vocab_size + 1, device=device)
    counts.scatter_add_(1, index.to(device), torch.ones(index.shape, device=device))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,  # [rows, vocab]
    prompt_counts: torch.Tensor,  # [rows, vocab]
    output_counts: torch.Tensor,  # [rows, vocab]
    repetition: torch.Tensor,  # [rows]
    presence: torch.Tensor,  # [rows]
    frequency: torch.Tensor,  # [rows]
) -> torch.Tensor:
    """Repetition penalty (HF/CTRL: divide positive, multiply negative logits of tokens seen in the prompt or the
    output), then the OpenAI presence and frequency penalties over the output tokens."""
    seen = (prompt_counts + output_counts) > 0
    rep = repetition[:, None].expand_as(logits)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - frequency[:, None] * output_counts
    return logits - presence[:, None] * (output_counts > 0).to(logits.dtype)


def apply_token_constraints(
    logits: torch.Tensor,  # [rows, vocab]
    allowed: dict[int, list[int]],  # row -> the only tokens it may sample
    bias: dict[int, dict[int, float]],  # row -> token -> additive bias
    banned: dict[int, list[int]],  # row -> tokens it may not sample
) -> torch.Tensor:
    if allowed:
        keep = torch.zeros(len(allowed), logits.shape[1], dtype=torch.bool, device=logits.device)
        rows = list(allowed)
        for i, row in enumerate(rows):
            keep[i, allowed[row]] = True
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(~keep, float("-inf"))
    pairs = [(row, tok, val) for row, b in bias.items() for tok, val in b.items()]
    if pairs:
        rows, toks, vals = zip(*pairs)
        logits.index_put_(
            (torch.tensor(rows), torch.tensor(toks)), torch.tensor(vals, dtype=logits.dtype), accumulate=True
        )
    pairs = [(row, tok) for row, toks in banned.items() for tok in toks]
    if pairs:
        index = torch.tensor(pairs, device=logits.device)
        logits[index[:, 0], index[:, 1]] = float("-inf")
    return logits
