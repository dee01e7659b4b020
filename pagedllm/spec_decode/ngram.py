"""N-gram prompt lookup: a request's drafts are the tokens that followed the latest earlier occurrence of its last n
tokens in its own history (prompt + output), for the longest n in [prompt_lookup_min, prompt_lookup_max] that
occurs. No model runs: it pays off where outputs copy their input (editing, summarizing, code, repetition).

The search is vectorized over the batch: the histories, right-aligned in one padded array [batch, length], are
compared with their own suffix at every offset, one n-gram length at a time (max_n passes over the array, no loop
per token). It costs O(batch * length * max_n) per step on the host: for large batches of long histories set
disable_by_batch_size, which also turns drafts off where the step is compute bound anyway (spec_decode/policy.py
applies it before the proposer runs)."""

from __future__ import annotations

import numpy as np

from pagedllm.spec_decode.config import SpeculativeConfig

PAD = -1  # left padding of the shorter histories: never equal to a token


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        # request id -> (its history as an array (capacity grows by doubling), how much of it is filled, the token
        # list it copies): only the tokens appended to that list since the last step are converted. A request's list
        # only grows (Request.all_token_ids); another list under the same id is another request
        self.histories: dict[str, tuple[np.ndarray, int, list[int]]] = {}

    def propose(self, token_ids: dict[str, list[int]]) -> dict[str, list[int]]:
        """request id -> its tokens so far => request id -> up to K drafts (rows without a match are left out)."""
        if not token_ids:
            self.histories.clear()
            return {}
        self.histories = {r: self._history(r, tokens) for r, tokens in token_ids.items()}  # the others are dropped
        tokens = pad_right_aligned([buf[:n] for buf, n, _ in self.histories.values()])
        drafts, counts = propose_batch(tokens, self.k, self.min_n, self.max_n)
        return {r: drafts[i, : counts[i]].tolist() for i, r in enumerate(token_ids) if counts[i]}

    def _history(self, req_id: str, tokens: list[int]) -> tuple[np.ndarray, int, list[int]]:
        buf, n, source = self.histories.get(req_id, (None, 0, None))
        if source is not tokens or n > len(tokens):  # a new request (or its id used again)
            buf, n = np.empty(max(2 * len(tokens), 64), dtype=np.int64), 0
        if len(tokens) > len(buf):
            buf = np.concatenate([buf[:n], np.empty(2 * len(tokens) - n, dtype=np.int64)])
        buf[n : len(tokens)] = tokens[n:]
        return buf, len(tokens), tokens


def pad_right_aligned(histories: list) -> np.ndarray:
    """histories (lists or arrays of token ids) -> [batch, longest] int64, each row's tokens at its end, PAD before
    them."""
    lengths = [len(h) for h in histories]
    out = np.full((len(histories), max(lengths, default=0)), PAD, dtype=np.int64)
    for row, (h, n) in enumerate(zip(histories, lengths)):  # one copy per row
        if n:
            out[row, out.shape[1] - n :] = h
    return out


def propose_batch(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> tuple[np.ndarray, np.ndarray]:
    """tokens [batch, length] right-aligned histories (PAD on the left) -> (drafts [batch, k], counts [batch]): a row's
    drafts[:count] follow the latest earlier occurrence of its longest matching suffix n-gram (count 0: no match).

    match[:, e] says whether the n tokens ending at e equal the row's last n tokens; it grows from n - 1 to n with one
    comparison pass, so the search costs max_n passes over [batch, length]. Only e <= length - 2 (a token follows)."""
    batch, length = tokens.shape
    drafts = np.zeros((batch, k), dtype=np.int64)
    counts = np.zeros(batch, dtype=np.int64)
    start = np.full(batch, -1, dtype=np.int64)  # where each row's continuation begins (-1: no match)
    if length < 2:
        return drafts, counts
    match = tokens[:, : length - 1] == tokens[:, length - 1, None]  # [batch, length - 1] 1-grams
    for n in range(1, min(max_n, length - 1) + 1):
        if n > 1:  # the token n - 1 before each end equals the suffix's n-th token from the end
            match[:, n - 1 :] &= tokens[:, : length - n] == tokens[:, length - n, None]
            match[:, n - 2] = False  # n-grams ending there would start before the history
        if n < min_n:
            continue
        found = match.any(axis=1) & (tokens[:, length - n] != PAD)  # a row shorter than n has no suffix n-gram
        latest = length - 2 - np.argmax(match[:, ::-1], axis=1)  # [batch] the last matching end
        start[found] = latest[found] + 1  # a longer n-gram found later overrides
    rows = np.flatnonzero(start >= 0)
    if len(rows):
        take = start[rows, None] + np.arange(k)  # [matched, k] positions after the match
        counts[rows] = np.minimum(k, length - start[rows])
        drafts[rows] = tokens[rows[:, None], np.minimum(take, length - 1)]
    return drafts, counts
