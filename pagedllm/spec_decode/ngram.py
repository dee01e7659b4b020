"""N-gram prompt lookup: a request's drafts are the tokens that followed the latest earlier occurrence of its last n
tokens in its own history (prompt + output), for the longest n in [prompt_lookup_min, prompt_lookup_max] that
occurs. No model runs: it pays off where outputs copy their input (editing, summarizing, code, repetition).

The search is vectorized over the batch: the histories, right-aligned in one padded array [batch, length], are
compared with their own suffix at every offset, one column of the n-gram at a time (n passes over the array, no
loop per token)."""

from __future__ import annotations

import numpy as np

from pagedllm.spec_decode.config import SpeculativeConfig

PAD = -1  # left padding of the shorter histories: never equal to a token


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.disable_by_batch_size = config.disable_by_batch_size

    def propose(self, token_ids: dict[str, list[int]]) -> dict[str, list[int]]:
        """request id -> its tokens so far => request id -> up to K drafts (rows without a match are left out). No
        drafts at all when more requests decode than disable_by_batch_size."""
        if not token_ids or (self.disable_by_batch_size is not None and len(token_ids) > self.disable_by_batch_size):
            return {}
        req_ids = list(token_ids)
        drafts, counts = propose_batch(pad_right_aligned(list(token_ids.values())), self.k, self.min_n, self.max_n)
        return {r: drafts[i, : counts[i]].tolist() for i, r in enumerate(req_ids) if counts[i]}


def pad_right_aligned(histories: list[list[int]]) -> np.ndarray:
    """histories -> [batch, longest] int64, each row's tokens at its end, PAD before them."""
    lengths = np.fromiter((len(h) for h in histories), dtype=np.int64, count=len(histories))
    out = np.full((len(histories), int(lengths.max(initial=0))), PAD, dtype=np.int64)
    if out.size:  # one conversion per row (in C), none per token
        flat = np.concatenate([np.asarray(h, dtype=np.int64) for h in histories])
        mask = np.arange(out.shape[1]) >= (out.shape[1] - lengths)[:, None]  # [batch, longest] the real tokens
        out[mask] = flat  # row-major: each row's tokens in order
    return out


def propose_batch(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> tuple[np.ndarray, np.ndarray]:
    """tokens [batch, length] right-aligned histories (PAD on the left) -> (drafts [batch, k], counts [batch]): a row's
    drafts[:count] follow the latest earlier occurrence of its longest matching suffix n-gram (count 0: no match)."""
    batch, length = tokens.shape
    drafts = np.zeros((batch, k), dtype=np.int64)
    counts = np.zeros(batch, dtype=np.int64)
    start = np.full(batch, -1, dtype=np.int64)  # where each row's continuation begins (-1: no match yet)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        open_rows = start < 0
        if not open_rows.any():
            break
        num_windows = length - n  # windows at offsets 0 .. length - n - 1: each has a token after it
        match = np.ones((batch, num_windows), dtype=bool)
        for j in range(n):  # window at offset s matches when tokens[s + j] == suffix[j] for every j
            match &= tokens[:, j : j + num_windows] == tokens[:, length - n + j, None]
        match &= tokens[:, length - n, None] != PAD  # a row shorter than n has no suffix n-gram
        found = match.any(axis=1) & open_rows
        latest = num_windows - 1 - np.argmax(match[:, ::-1], axis=1)  # [batch] the last matching offset
        start[found] = latest[found] + n
    rows = np.flatnonzero(start >= 0)
    if len(rows):
        take = start[rows, None] + np.arange(k)  # [matched, k] positions after the match
        counts[rows] = np.minimum(k, length - start[rows])
        drafts[rows] = tokens[rows[:, None], np.minimum(take, length - 1)]
    return drafts, counts
