"""Draft verification: which tokens a request emits, and where its target tokens' rows and logits come from."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm.sample.verify import accept, expand_rows, logits_positions


def reference_accept(drafts, targets):
    """Each position in turn: emit the target token; go on only while it equals the draft there."""
    out, i = [], 0
    for d in drafts:
        emitted = []
        for j in range(len(d) + 1):
            emitted.append(targets[i + j])
            if j == len(d) or d[j] != targets[i + j]:
                break
        out.append(emitted)
        i += len(d) + 1
    return out


@pytest.mark.parametrize(
    "drafts, targets, expected",
    [
        ([[]], [5], [[5]]),  # no drafts: the one sampled token
        ([[1, 2, 3]], [1, 2, 3, 4], [[1, 2, 3, 4]]),  # all accepted + the token after the last draft
        ([[1, 2, 3]], [1, 9, 3, 4], [[1, 9]]),  # the second differs: 9 is emitted in its place, the rest dropped
        ([[1, 2, 3]], [7, 2, 3, 4], [[7]]),  # none accepted
        ([[1], [], [4, 4]], [1, 8, 6, 4, 5, 0], [[1, 8], [6], [4, 5]]),
    ],
)
def test_accept(drafts, targets, expected):
    assert accept(drafts, targets) == expected


def test_accept_matches_a_token_by_token_reference():
    rng = np.random.default_rng(0)
    for _ in range(200):
        drafts = [rng.integers(0, 3, rng.integers(0, 5)).tolist() for _ in range(rng.integers(1, 5))]
        targets = rng.integers(0, 3, sum(len(d) + 1 for d in drafts)).tolist()
        assert accept(drafts, targets) == reference_accept(drafts, targets)


def test_accept_refuses_a_wrong_number_of_targets():
    with pytest.raises(ValueError, match="3 target tokens for 4 verified positions"):
        accept([[1, 2, 3]], [1, 2, 3])


def test_expand_rows_and_logits_positions():
    rows, num_tokens, num_drafts = np.array([4, 0, 2]), np.array([10, 7, 3]), np.array([2, 0, 1])
    ex_rows, ex_tokens = expand_rows(rows, num_tokens, num_drafts)
    assert ex_rows.tolist() == [4, 4, 4, 0, 2, 2]
    assert ex_tokens.tolist() == [10, 11, 12, 7, 3, 4]
    # flat batch: request 0 schedules tokens [0, 5) (known token at 2, drafts at 3, 4), request 1 [5, 6),
    # request 2 [6, 9) (its known token at 7, a draft at 8)
    assert logits_positions(np.array([5, 6, 9]), num_drafts).tolist() == [2, 3, 4, 5, 7, 8]
