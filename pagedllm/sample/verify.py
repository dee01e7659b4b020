"""Verification of draft tokens (speculative decoding).

A request with k drafts samples k + 1 target tokens in one step: at its last known position and at each draft
position, each from the target model's logits given the tokens before it (the drafts included) and with the
request's own sampling rules (a seeded row draws by (seed, position), as without drafts). Drafts are accepted while
each equals the target token sampled at its position; the request emits the accepted drafts and the first target
token that differs (or, all accepted, the one after the last draft). Each emitted token is thus sampled from the
target given the accepted prefix: the output is distributed exactly as without drafts, greedy or sampled."""

from __future__ import annotations

import numpy as np


def expand_rows(rows: np.ndarray, num_tokens: np.ndarray, num_drafts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sampling rows of a step with drafts: each request's row once per target token, each with its number of
    tokens before that position. rows, num_tokens, num_drafts [n] -> (rows, num_tokens) [sum(num_drafts + 1)]"""
    counts = num_drafts + 1
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    offsets = np.arange(int(counts.sum())) - starts  # 0..k of each request
    return np.repeat(rows, counts), np.repeat(num_tokens, counts) + offsets


def logits_positions(query_end: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
    """Where in the flat batch each target token's logits come from: a request's last k + 1 scheduled tokens (its
    last known token, then its drafts). query_end [n]: one past each request's last scheduled token ->
    [sum(num_drafts + 1)]"""
    counts = num_drafts + 1
    ends = np.repeat(query_end, counts)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    return ends - counts.repeat(counts) + (np.arange(int(counts.sum())) - starts)


def accept(drafts: list[list[int]], targets: list[int]) -> list[list[int]]:
    """drafts: per request its k drafts; targets: flat, per request the k + 1 target tokens sampled at its last
    known position and at each draft position, in order -> per request the emitted tokens (1 to k + 1)."""
    emitted, start = [], 0
    for d in drafts:
        t = targets[start : start + len(d) + 1]
        n = 0
        while n < len(d) and d[n] == t[n]:
            n += 1
        emitted.append(t[: n + 1])
        start += len(d) + 1
    if start != len(targets):
        raise ValueError(f"{len(targets)} target tokens for {start} verified positions")
    return emitted
