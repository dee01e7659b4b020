"""min-p in the Triton sampling kernel against a plain re-implementation: a token is kept when its probability is at
least min_p times the most likely token's, ties included; min_p 1 keeps exactly the most likely tokens. Without CUDA
the kernel runs in Triton's interpreter (see conftest.py) over tiny tiles."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

import sampling_kernels  # noqa: E402

from pagedllm.kernels import sampling_inputs  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK = 4096 if DEVICE.type == "cuda" else 16  # the interpreter runs every op in Python: tiny tiles

sampling = sampling_kernels.load()[-1]


def draw(x: torch.Tensor, temperature: float, min_p: float, top_k: int, position: int) -> list[int]:
    """The kernel's token for each row of x [rows, vocab], row i seeded by i + 11 at the position."""
    n = x.shape[0]
    full = lambda v, dtype=np.float32: np.full(n, v, dtype=dtype)  # noqa: E731
    params = sampling_inputs.pack_params(
        full(temperature), full(top_k), full(1.0), full(min_p), np.arange(n, dtype=np.int64) + 11,
        np.ones(n, dtype=bool), full(position, np.int64),
    )  # fmt: skip
    inputs = sampling_kernels.device_inputs(params)
    return sampling.sample(x.to(DEVICE), inputs, 0, block=BLOCK).cpu().tolist()


def min_p_kept(x: torch.Tensor, temperature: float, min_p: float) -> set[int]:
    """The plain rule in float64: p = softmax(x / T), keep p >= min_p * max(p). x [vocab]"""
    p = (x.double() / temperature).softmax(-1)
    return set(torch.nonzero(p >= min_p * p.max()).flatten().tolist())


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.7, 3)])
def test_min_p_one_draws_only_the_most_likely_tokens_ties_included(temperature, top_k):
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(1)) * 3  # 40: two tiles and a partial one
    x[:, 7] = 9.0
    x[1:, 38] = 9.0
    x[2, 0] = 9.0
    seen = [set() for _ in x]
    for position in range(16):
        for i, token in enumerate(draw(x, temperature, 1.0, top_k, position)):
            seen[i].add(token)
    for i in range(len(x)):
        assert seen[i] == min_p_kept(x[i], temperature, 1.0), (i, seen[i])


@pytest.mark.parametrize("min_p", [0.1, 0.6])
def test_min_p_draws_lie_in_the_plain_rules_kept_set(min_p):
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(2)) * 2
    for position in range(8):
        for i, token in enumerate(draw(x, 0.8, min_p, 0, position)):
            assert token in min_p_kept(x[i], 0.8, min_p), (i, token)
