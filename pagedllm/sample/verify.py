"""Verification of draft tokens (speculative decoding).

A request with k drafts samples k + 1 target tokens in one step: at its last known position and at each draft
position, each from the target model's logits given the tokens before it (the drafts included) and with the
request's own sampling rules (a seeded row draws by (seed, position), as without drafts). Drafts are accepted while
each equals the target token sampled at its position; the request emits the accepted drafts and the first target
token that differs (or, all accepted, the one after the last draft). Each emitted token is thus sampled from the
target given the accepted prefix: the output is distributed exactly as without drafts, greedy or sampled.

This is the standard rejection rule for a draft distribution q that is a point mass on the draft t (n-gram and
other deterministic proposers): the draft is accepted with probability p(t) (the target, after temperature,
penalties, top-k / top-p / min-p, as a step without drafts applies them), and on rejection the emitted token is
drawn from the residual max(p - q, 0) normalized, i.e. p without t: exactly the law of a token x ~ p given x != t.
Greedy rows take the argmax at each position: drafts are accepted while they equal it, then the argmax follows (the
corrected or bonus token). A seeded row draws each position by (seed, position) as without drafts, so its output is
the same token for token with or without them."""

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
    counts = np.fromiter((len(d) + 1 for d in drafts), dtype=np.int64, count=len(drafts))
    starts = np.cumsum(counts) - counts
    if int(counts.sum()) != len(targets):
        raise ValueError(f"{len(targets)} target tokens for {int(counts.sum())} verified positions")
    emitted = num_emitted(np.fromiter((t for d in drafts for t in (*d, -1)), np.int64, len(targets)), targets, counts)
    return [targets[s : s + e] for s, e in zip(starts.tolist(), emitted.tolist())]


def num_emitted(padded_drafts: np.ndarray, targets, counts: np.ndarray) -> np.ndarray:
    """How many tokens each request emits: its accepted drafts + 1. padded_drafts, targets [sum(counts)]: per request
    its k drafts then one never-matching -1, and its k + 1 target tokens; counts [n] k + 1 -> [n]"""
    miss = np.asarray(padded_drafts) != np.asarray(targets)  # the last of each request always misses
    first_miss = np.flatnonzero(miss)  # a request's first miss is the first at or after its start
    starts = np.cumsum(counts) - counts
    return first_miss[np.searchsorted(first_miss, starts)] - starts + 1
