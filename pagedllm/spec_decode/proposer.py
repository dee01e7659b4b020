"""The proposer interface, and a proposer that replays recorded continuations (for tests).

The engine core asks the proposer after each step for the running requests that decode and may speculate; the
scheduler schedules the drafts after each request's known tokens (fewer where the budget or max_tokens leave less
room), and the model runner verifies them: the accepted drafts and one sampled token come back."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol


class Proposer(Protocol):
    def propose(self, token_ids: dict[str, list[int]]) -> Mapping[str, list[int]]:
        """request id -> its tokens so far (prompt + output; the request's own list, read only, which only grows) =>
        request id -> draft tokens to verify after them (requests left out get none): a dict, or a DeviceDrafts
        whose tokens are still on the device (spec_decode/device_drafts.py)."""
        ...


class ReplayProposer:
    """Proposes the continuation of a recorded sequence that the request's tokens so far begin (e.g. the greedy
    outputs of a run without drafts), num_drafts tokens at a time. A draft at position p is corrupted (replaced by
    another token) when hash((seed, p)) % corrupt_every == 0, so that verification rejects some. A request that
    follows no recorded sequence gets its last token repeated (drafts that are mostly rejected)."""

    def __init__(
        self, sequences: list[list[int]], num_drafts: int, vocab_size: int, corrupt_every: int = 0, seed: int = 0
    ) -> None:
        if num_drafts < 1:
            raise ValueError(f"num_drafts={num_drafts!r} must be >= 1")
        self.sequences = [list(s) for s in sequences]
        self.num_drafts = num_drafts
        self.vocab_size = vocab_size
        self.corrupt_every = corrupt_every
        self.seed = seed
        self.num_proposed = 0  # drafts proposed so far

    def propose(self, token_ids: dict[str, list[int]]) -> dict[str, list[int]]:
        drafts = {req_id: self._drafts(tokens) for req_id, tokens in token_ids.items()}
        drafts = {req_id: d for req_id, d in drafts.items() if d}
        self.num_proposed += sum(len(d) for d in drafts.values())
        return drafts

    def _drafts(self, tokens: list[int]) -> list[int]:
        n = len(tokens)
        follows = next((s for s in self.sequences if len(s) > n and s[:n] == tokens), None)
        if follows is None:
            return [tokens[-1]] * self.num_drafts
        drafts = follows[n : n + self.num_drafts]
        return [self._corrupt(t, n + i) for i, t in enumerate(drafts)]

    def _corrupt(self, token: int, position: int) -> int:
        if self.corrupt_every and hash((self.seed, position)) % self.corrupt_every == 0:
            return (token + 1) % self.vocab_size
        return token
