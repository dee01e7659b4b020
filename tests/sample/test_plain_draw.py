"""The sampler's plain rows (temperature, min-p; no top-k / top-p) off the GPU: the two-level inverse CDF against the
one-level one and a float64 reference, frequencies against softmax(x / T) (min-p renormalized) in mixed batches
that take several blocks of rows, and the NaN / inf rules."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from pagedllm.sample import sampler as sampler_module
from pagedllm.sample.metadata import SamplingMetadata, seeded_uniform
from pagedllm.sample.sampler import Sampler, _draw, _draw_two_level

CPU = torch.device("cpu")


def meta(temperature, top_k=None, min_p=None, seeds=None, positions=None) -> SamplingMetadata:
    """seeds: {row: seed} for the seeded rows; positions: {row: tokens generated so far} (default 0)."""
    n = len(temperature)
    seeds, positions = seeds or {}, positions or {}
    return SamplingMetadata.build(
        np.array(temperature, dtype=np.float32),
        np.array(top_k if top_k is not None else [0] * n, dtype=np.int64),
        np.ones(n, dtype=np.float32),
        np.array(min_p if min_p is not None else [0.0] * n, dtype=np.float32),
        seeds=np.array([seeds.get(i, 0) for i in range(n)], dtype=np.int64),
        seeded=np.array([i in seeds for i in range(n)]),
        positions=np.array([positions.get(i, 0) for i in range(n)], dtype=np.int64),
    )


def pad(p: torch.Tensor, chunk: int) -> torch.Tensor:
    """p [rows, n] with zero columns up to a multiple of chunk."""
    return torch.nn.functional.pad(p, (0, -p.shape[1] % chunk))


def test_two_level_equals_one_level_when_the_sums_are_exact():
    """Small integer weights sum exactly in float32 in any order: both draws must agree on every u, including u at
    the boundaries, 0 and the largest float below 1, and never pick a zero weight."""
    g = torch.Generator().manual_seed(0)
    rows, width, chunk = 4000, 1000, 64  # 16 chunks, the last one partial
    w = torch.randint(0, 8, (rows, width), generator=g).float()
    w[w < 3] = 0  # many zero weights, whole zero chunks too
    w[:, 200:300] = 0
    total = w.sum(dim=1)
    at = torch.randint(0, width, (rows,), generator=g)
    boundary = w.cumsum(dim=1).gather(1, at[:, None]).squeeze(1) / total  # u at (or next to) a boundary
    u = torch.rand(rows, generator=g)
    u[::4] = boundary[::4]
    u[1::4] = torch.nextafter(boundary[1::4], torch.zeros(1))
    u[2::16], u[3::16] = 0.0, torch.nextafter(torch.ones(1), torch.zeros(1))
    ours = _draw_two_level(pad(w, chunk), u, chunk)
    assert torch.equal(ours, _draw(w.clone(), u))
    assert (w.gather(1, ours[:, None]) > 0).all()


def test_two_level_matches_one_level_on_float_weights():
    """Float weights sum differently in the two orders: the draws may differ only where u falls within rounding
    of a boundary (rare), and then by one token."""
    g = torch.Generator().manual_seed(1)
    rows, width = 2000, 20000  # 19 chunks of 1024 and a partial one
    p = (torch.randn(rows, width, generator=g) * 3).exp()
    u = torch.rand(rows, generator=g)
    ours = _draw_two_level(pad(p, 1024), u)
    ref = _draw(p.clone(), u)
    differ = torch.nonzero(ours != ref).squeeze(1)
    assert len(differ) <= rows // 100
    cdf = p.double().cumsum(dim=1)
    for i in differ.tolist():  # the mass between the two picks is within float32 rounding of the row's total
        lo, hi = sorted((int(ours[i]), int(ref[i])))
        assert cdf[i, hi - 1] - cdf[i, lo] <= 1e-6 * cdf[i, -1]


def test_plain_rows_match_a_float64_inverse_cdf():
    """Seeded plain rows (their u is known) against an independent float64 inverse CDF of softmax(x / T)."""
    g = torch.Generator().manual_seed(2)
    rows, vocab = 300, 5000
    x = torch.randn(rows, vocab, generator=g) * 2
    temperature = np.linspace(0.3, 1.5, rows)
    seeds = {i: 1000 + i for i in range(rows)}
    tokens = Sampler(CPU, seed=0)(x, meta(temperature, seeds=seeds, positions=seeds))
    u = torch.from_numpy(seeded_uniform(np.arange(rows) + 1000, np.arange(rows) + 1000)).double()
    cdf = (x.double() / torch.from_numpy(temperature)[:, None]).softmax(dim=1).cumsum(dim=1)
    ref = torch.searchsorted(cdf, u[:, None], right=True).squeeze(1)
    assert (tokens != ref).sum() <= 3  # rounding at a boundary only


def chi_square_pvalue(tokens: torch.Tensor, p: torch.Tensor) -> float:
    """Pearson's test of the drawn tokens against p [vocab] (cells expected below 5 pooled); p = 0 never drawn."""
    counts = torch.bincount(tokens, minlength=len(p)).double()
    assert counts[p == 0].sum() == 0, "a token of probability 0 was drawn"
    expected = p * len(tokens)
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(stats.chi2.sf(float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1))


def expected_probs(x: torch.Tensor, temperature: float, min_p: float = 0.0) -> torch.Tensor:
    p = (x.double() / temperature).softmax(-1)
    p = torch.where(p >= min_p * p.max(), p, 0.0)
    return p / p.sum()


@pytest.mark.parametrize("all_plain", [True, False])
def test_plain_frequencies_in_blocks_of_rows(monkeypatch, all_plain):
    """A vocabulary of 2,500 (two chunks of 1,024 and a partial one) with mass in each chunk; a block of a few rows,
    so the draw takes hundreds of blocks. Mixed: greedy, two plain kinds (one with min-p) and top-k rows."""
    monkeypatch.setattr(sampler_module, "_BLOCK_BYTES", 64 << 10)  # 6 rows of 2,500 floats
    g = torch.Generator().manual_seed(3)
    base = torch.randn(2500, generator=g)
    base[[3, 1023, 1024, 2047, 2048, 2499]] += torch.tensor([4.0, 3.0, 3.5, 2.5, 4.5, 3.0])
    n = 3000
    if all_plain:
        temps, mins = [0.8] * n, [0.0] * n
        kinds = {"plain": (slice(None), 0.8, 0.0)}
    else:
        temps, mins = [0.0, 0.8, 1.3, 1.0] * n, [0.0, 0.0, 0.05, 0.0] * n
        kinds = {"plain": (slice(1, None, 4), 0.8, 0.0), "min_p": (slice(2, None, 4), 1.3, 0.05)}
    rows = len(temps)
    top_k = [0] * rows if all_plain else [0, 0, 0, 2] * n
    logits = base.expand(rows, -1)
    before = logits.clone()
    tokens = Sampler(CPU, seed=4)(logits, meta(temps, top_k=top_k, min_p=mins))
    assert torch.equal(logits, before)  # the sampler only reads the logits
    for name, (rows_of_kind, temperature, min_p) in kinds.items():
        assert chi_square_pvalue(tokens[rows_of_kind], expected_probs(base, temperature, min_p)) > 1e-3, name
    if not all_plain:
        assert (tokens[0::4] == base.argmax()).all()
        assert set(tokens[3::4].tolist()) <= set(base.topk(2).indices.tolist())


def test_seeded_plain_row_is_independent_of_its_batch_and_block(monkeypatch):
    monkeypatch.setattr(sampler_module, "_BLOCK_BYTES", 3 * 4000 * 4)  # 3 rows a block
    x = torch.randn(7, 4000, generator=torch.Generator().manual_seed(5)) * 2

    def draw(batch: torch.Tensor, at: int, step: int) -> int:
        m = meta([0.9] * len(batch), min_p=[0.01] * len(batch), seeds={at: 42}, positions={at: step})
        return int(Sampler(CPU, seed=at + 100 + step)(batch, m)[at])  # a different unseeded stream each time

    alone = [draw(x[1:2], 0, step) for step in range(6)]
    assert [draw(x, 1, step) for step in range(6)] == alone  # first block
    assert [draw(x[[3, 0, 2, 6, 1]], 4, step) for step in range(6)] == alone  # second block, other neighbours
    assert len(set(alone)) > 1


@pytest.mark.parametrize("top_k", [0, 3])  # plain rows and filtered rows
def test_nan_is_never_drawn_inf_wins_and_banned_rows_take_token_0(top_k):
    nan, inf = float("nan"), float("inf")
    x = torch.tensor(
        [
            [nan, 1.0, nan, 0.5, nan, nan],
            [-inf, -inf, -inf, -inf, -inf, -inf],
            [nan, -inf, nan, nan, -inf, nan],
            [0.0, 1.0, inf, 2.0, 3.0, 1e30],
            [3e38, 2.0, -3e38, 0.0, 1.0, 0.0],  # x / T overflows: the first token becomes the largest float
        ]
    ).repeat(40, 1)
    rows = len(x)
    tokens = Sampler(CPU, seed=6)(x, meta([0.7] * rows, top_k=[top_k] * rows, min_p=[0.0, 0.1] * (rows // 2)))
    tokens = tokens.view(40, 5)
    assert set(tokens[:, 0].tolist()) == {1, 3}  # both finite tokens come, NaN never
    assert (tokens[:, 1:] == torch.tensor([0, 0, 2, 0])).all()
