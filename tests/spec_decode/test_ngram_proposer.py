"""The n-gram proposer against a plain token-by-token re-implementation of prompt lookup, and its batch rules."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm.spec_decode import NgramProposer, SpeculativeConfig
from pagedllm.spec_decode.ngram import pad_right_aligned, propose_batch


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """For n from max_n down to min_n: the latest earlier occurrence of the last n tokens that has a token after it;
    the (up to k) tokens after it."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def propose(config: SpeculativeConfig, histories: list[list[int]]) -> list[list[int]]:
    out = NgramProposer(config).propose({str(i): h for i, h in enumerate(histories)})
    return [out.get(str(i), []) for i in range(len(histories))]


@pytest.mark.parametrize("k, min_n, max_n", [(1, 1, 1), (3, 1, 3), (5, 2, 4), (4, 3, 3)])
def test_matches_the_token_by_token_reference(k, min_n, max_n):
    rng = np.random.default_rng(k * 100 + min_n * 10 + max_n)
    config = SpeculativeConfig("ngram", k, max_n, min_n)
    for _ in range(40):  # batches of random lengths (0 included) over small vocabularies: many partial matches
        histories = [rng.integers(0, rng.integers(2, 6), rng.integers(0, 30)).tolist() for _ in range(8)]
        assert propose(config, histories) == [reference(h, k, min_n, max_n) for h in histories]


def test_longest_ngram_wins_and_rows_without_a_match_get_none():
    config = SpeculativeConfig("ngram", 3, 3, 1)
    histories = [
        [1, 2, 3, 9, 9, 7, 2, 3, 4, 1, 2, 3],  # 3-gram [1, 2, 3] at 0 (-> 9 9 7) beats the later 2-gram [2, 3] at 6
        [5, 6, 7, 8],  # nothing repeats
        [4, 4],  # 1-gram [4] at 0: one token after it
    ]
    assert propose(config, histories) == [[9, 9, 7], [], [4]]
    assert NgramProposer(config).propose({"a": histories[1]}) == {}  # a row with no match is left out


def test_padding_never_matches():
    tokens = pad_right_aligned([[0, 0], [0, 1, 0, 1, 0]])
    assert tokens[0].tolist() == [-1, -1, -1, 0, 0]
    drafts, counts = propose_batch(tokens, 4, 1, 3)
    assert counts.tolist() == [1, 2]  # row 0: [0] at 0 -> [0]; row 1: [0, 1, 0] at 0 -> [1, 0]
    assert drafts[1, :2].tolist() == [1, 0]


def test_histories_kept_between_steps_propose_as_a_fresh_proposer():
    """The proposer converts only the tokens appended since its last call: over growing histories, an id used again
    for another request and requests that leave, it proposes what a fresh proposer proposes."""
    rng = np.random.default_rng(5)
    config = SpeculativeConfig("ngram", 3, 3, 1)
    kept = NgramProposer(config)
    histories = {str(i): rng.integers(0, 4, 10).tolist() for i in range(4)}
    for step in range(60):
        for tokens in histories.values():
            tokens.extend(rng.integers(0, 4, rng.integers(1, 4)).tolist())
        if step % 7 == 3:  # request 0 leaves; a new request takes its id
            histories["0"] = rng.integers(0, 4, rng.integers(1, 90)).tolist()
        if step % 5 == 0:
            histories.pop("3", None)
        assert kept.propose(histories) == NgramProposer(config).propose(histories)
        assert set(kept.histories) == set(histories)
