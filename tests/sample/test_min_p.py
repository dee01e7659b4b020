"""min-p on every CPU sampling path against a plain re-implementation: a token is kept when its probability is at
least min_p times the most likely token's, ties included; min_p 1 keeps exactly the most likely tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler


@pytest.fixture(autouse=True)
def _paths(sampling_path):
    """Every test here runs on each CPU sampling path."""


def min_p_kept(x: torch.Tensor, temperature: float, min_p: float) -> set[int]:
    """The plain rule in float64: p = softmax(x / T), keep p >= min_p * max(p). x [vocab]"""
    p = (x.double() / temperature).softmax(-1)
    return set(torch.nonzero(p >= min_p * p.max()).flatten().tolist())


def seen_tokens(x: torch.Tensor, temperature: float, min_p: float, top_k: int = 0, draws: int = 40) -> list[set]:
    """Every token drawn for each row of x [rows, vocab] over `draws` seeded positions."""
    n = x.shape[0]
    sampler = Sampler(torch.device("cpu"), seed=0)
    seen = [set() for _ in range(n)]
    for position in range(draws):
        meta = SamplingMetadata.build(
            np.full(n, temperature, np.float32), np.full(n, top_k, np.int64), np.ones(n, np.float32),
            np.full(n, min_p, np.float32), seeds=np.arange(n, dtype=np.int64) + 11, seeded=np.ones(n, dtype=bool),
            positions=np.full(n, position, dtype=np.int64),
        )  # fmt: skip
        for i, token in enumerate(sampler(x.clone(), meta).tolist()):
            seen[i].add(token)
    return seen


def peaked_rows(vocab: int) -> torch.Tensor:
    """6 rows: a clear favourite at token 7; rows 3.. tie it at token vocab - 2 (and row 5 at token 0 too)."""
    x = torch.randn(6, vocab, generator=torch.Generator().manual_seed(vocab)) * 3
    x[:, 7] = 20.0
    x[3:, vocab - 2] = 20.0
    x[5, 0] = 20.0
    return x


@pytest.mark.parametrize("vocab", [50, 1000, 20000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("top_k", [0, 5])
def test_min_p_one_draws_only_the_most_likely_tokens_ties_included(vocab, temperature, top_k):
    x = peaked_rows(vocab)
    for i, seen in enumerate(seen_tokens(x, temperature, 1.0, top_k)):
        assert seen == min_p_kept(x[i], temperature, 1.0), (i, seen)  # 40 draws: each of 3 ties shows up


@pytest.mark.parametrize("vocab", [1000, 20000])
@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.9])
def test_min_p_draws_lie_in_the_plain_rules_kept_set(vocab, min_p):
    x = torch.randn(4, vocab, generator=torch.Generator().manual_seed(3)) * 3
    x[:2, :4] += 9  # a few strong tokens, then a tail on the other rows
    for i, seen in enumerate(seen_tokens(x, 0.8, min_p)):
        kept = min_p_kept(x[i], 0.8, min_p)
        assert seen <= kept, (i, seen - kept)
        p = (x[i].double() / 0.8).softmax(-1)
        likely = {t for t in kept if p[t] >= 0.2 * p[sorted(kept)].sum()}  # each missed by 40 draws at odds < 1e-3
        assert likely <= seen, (i, likely - seen)
