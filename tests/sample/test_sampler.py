"""The vectorized sampler against HF transformers' logits processors and plain re-implementations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sampling_reference import hf_kept
from transformers import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from pagedllm.sample.metadata import SamplingMetadata, seeded_uniform
from pagedllm.sample.sampler import CANDIDATES, Sampler


@pytest.fixture(autouse=True)
def _paths(sampling_path):
    """Every test here runs on each CPU sampling path."""


VOCAB = 1000


def _logits(rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _meta(temperature, top_k=None, top_p=None, min_p=None, seeds=None, positions=None) -> SamplingMetadata:
    """seeds: {row: seed} for the seeded rows; positions: {row: tokens generated so far} (default 0)."""
    n = len(temperature)
    seeds, positions = seeds or {}, positions or {}
    return SamplingMetadata.build(
        np.array(temperature, dtype=np.float32),
        np.array(top_k if top_k is not None else [0] * n, dtype=np.int64),
        np.array(top_p if top_p is not None else [1.0] * n, dtype=np.float32),
        np.array(min_p if min_p is not None else [0.0] * n, dtype=np.float32),
        seeds=np.array([seeds.get(i, 0) for i in range(n)], dtype=np.int64),
        seeded=np.array([i in seeds for i in range(n)]),
        positions=np.array([positions.get(i, 0) for i in range(n)], dtype=np.int64),
    )


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drops tokens whose probability is below min_p times the most likely token's."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Keeps each row's k most likely tokens, then the smallest set whose probability reaches top_p: the plain
    sort-based reference (checked against HF below) for the sampler's thresholds."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)  # ascending
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        threshold = sorted_logits.gather(1, (vocab - k)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < threshold, float("-inf"))
    if top_p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - top_p[:, None])
        drop[:, -1] = False  # the most likely token always stays
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _kept(x: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(x)


def test_top_k_matches_hf_per_row():
    logits = _logits(5)
    ks = [1, 5, 50, 0, 999]  # 0 = off
    ours = apply_top_k_top_p(logits, torch.tensor(ks), None)
    for i, k in enumerate(ks):
        ref = logits[i : i + 1] if k == 0 else TopKLogitsWarper(k)(None, logits[i : i + 1].clone())
        assert torch.equal(_kept(ours[i]), _kept(ref[0])), k
        assert torch.equal(ours[i][_kept(ours[i])], logits[i][_kept(ours[i])])


def test_top_p_matches_hf_per_row():
    logits = _logits(4, seed=1)
    ps = [0.1, 0.5, 0.9, 1.0]
    ours = apply_top_k_top_p(logits, None, torch.tensor(ps))
    for i, p in enumerate(ps):
        ref = TopPLogitsWarper(p)(None, logits[i : i + 1].clone())
        assert torch.equal(_kept(ours[i]), _kept(ref[0])), p


def test_top_k_then_top_p_matches_hf_chain():
    logits = _logits(3, seed=2)
    ks, ps = [10, 0, 200], [0.8, 0.3, 0.95]
    ours = apply_top_k_top_p(logits, torch.tensor(ks), torch.tensor(ps))
    for i in range(3):
        ref = logits[i : i + 1].clone()
        if ks[i]:
            ref = TopKLogitsWarper(ks[i])(None, ref)
        ref = TopPLogitsWarper(ps[i])(None, ref)
        assert torch.equal(_kept(ours[i]), _kept(ref[0]))


def test_min_p_matches_hf():
    logits = _logits(3, seed=3)
    mins = [0.0, 0.05, 0.5]
    ours = apply_min_p(logits, torch.tensor(mins))
    for i, m in enumerate(mins):
        ref = logits[i : i + 1] if m == 0 else MinPLogitsWarper(m)(None, logits[i : i + 1].clone())
        assert torch.equal(_kept(ours[i]), _kept(ref[0]))


def test_greedy_rows_in_a_mixed_batch_take_the_argmax():
    logits = _logits(4, seed=4)
    out = Sampler(torch.device("cpu"), seed=0)(logits, _meta([0.0, 1.0, 0.0, 0.7]))
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_top_k_one_is_greedy_at_any_temperature():
    logits = _logits(3, seed=5)
    out = Sampler(torch.device("cpu"), seed=0)(logits, _meta([2.0, 1.0, 0.5], top_k=[1, 1, 1]))
    assert torch.equal(out, logits.argmax(dim=-1))


def test_sampled_frequencies_follow_the_softmax():
    torch.manual_seed(0)
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    temperature = 0.8
    rows = 20000
    logits = base.repeat(rows, 1)
    sampler = Sampler(torch.device("cpu"), seed=123)
    tokens = sampler(logits, _meta([temperature] * rows))
    freq = torch.bincount(tokens, minlength=5).float() / rows
    expected = (base / temperature).softmax(-1)
    # 4 standard errors of a binomial proportion at n=20000
    tol = 4 * (expected * (1 - expected) / rows).sqrt()
    assert ((freq - expected).abs() <= tol).all(), (freq, expected)


def test_sampled_tokens_stay_inside_the_filtered_set():
    logits = _logits(64, seed=6)
    sampler = Sampler(torch.device("cpu"), seed=7)
    allowed = apply_top_k_top_p(logits, torch.full((64,), 20), torch.full((64,), 0.7))
    for _ in range(20):
        tokens = sampler(logits, _meta([1.0] * 64, top_k=[20] * 64, top_p=[0.7] * 64))
        assert torch.isfinite(allowed.gather(1, tokens[:, None])).all()


@pytest.mark.parametrize("position", [0, 3])
@pytest.mark.parametrize("vocab", [VOCAB, 20000])  # 20000: candidates from tiles (tiles.py), with a tail
def test_seeded_row_is_independent_of_its_batch(position, vocab):
    logits = _logits(4, seed=8, vocab=vocab)
    row = logits[1].clone()

    def draw(batch: torch.Tensor, at: int, step: int) -> int:
        sampler = Sampler(torch.device("cpu"), seed=at + 100 + step)  # a different unseeded stream each time
        meta = _meta([1.0] * len(batch), top_p=[0.9] * len(batch), seeds={at: 42}, positions={at: step})
        return int(sampler(batch.clone(), meta)[at])

    alone = [draw(row[None, :], 0, step) for step in range(8)]
    mixed = logits.clone()
    mixed[position] = row
    assert [draw(mixed, position, step) for step in range(8)] == alone
    assert len(set(alone)) > 1  # the position moves the stream on


def test_seeded_uniforms_are_uniform_and_differ_by_seed_and_position():
    seeds = np.repeat(np.arange(200, dtype=np.int64), 500) * 7919 - 10**6  # negative seeds too
    positions = np.tile(np.arange(500, dtype=np.int64), 200)
    u = seeded_uniform(seeds, positions)
    assert u.dtype == np.float32 and ((u >= 0) & (u < 1)).all()
    counts = np.histogram(u, bins=20, range=(0, 1))[0]
    expected = len(u) / 20
    assert (np.abs(counts - expected) <= 5 * expected**0.5).all(), counts
    assert len(set(u.tolist())) > 0.99 * len(u)
    extremes = seeded_uniform(np.array([2**63 - 1, -(2**63), -1, 0]), np.zeros(4, dtype=np.int64))
    assert ((extremes >= 0) & (extremes < 1)).all() and len(set(extremes.tolist())) == 4


def _hf_kept(logits: torch.Tensor, k: int, p: float, min_p: float = 0.0) -> set[int]:
    return set(torch.nonzero(hf_kept(logits, 1.0, k, p, min_p)).flatten().tolist())


def _support(logits, k, p, min_p=0.0, draws=300):
    """Every token the sampler picks over many draws of the same rows (with min_p, top_k, top_p)."""
    rows = logits.shape[0]
    sampler = Sampler(torch.device("cpu"), seed=3)
    seen = [set() for _ in range(rows)]
    meta = _meta([1.0] * rows, top_k=[k] * rows, top_p=[p] * rows, min_p=[min_p] * rows)
    for _ in range(draws):
        for i, t in enumerate(sampler(logits.clone(), meta).tolist()):
            seen[i].add(t)
    return seen


@pytest.mark.parametrize("top_k, top_p, min_p", [(0, 0.5, 0.0), (40, 1.0, 0.0), (40, 0.8, 0.0), (5, 0.3, 0.1)])
def test_candidate_path_samples_inside_hf_kept_set(top_k, top_p, min_p):
    logits = _logits(4, seed=9)
    logits[:, :3] += 8  # peaked rows: their nucleus lies among the top candidates
    for i, seen in enumerate(_support(logits, top_k, top_p, min_p)):
        kept = _hf_kept(logits[i], top_k, top_p, min_p)
        assert seen <= kept
        if len(kept) <= 5:
            assert seen == kept  # small sets are seen in full over 300 draws


@pytest.mark.parametrize("top_p, min_p", [(0.9, 0.0), (0.5, 0.0), (0.95, 0.02)])
def test_histogram_path_keeps_exactly_hf_top_p_set(top_p, min_p):
    from pagedllm.sample.sampler import _nucleus_threshold_by_histogram, _Scratch

    x = torch.randn(3, 49152, generator=torch.Generator().manual_seed(10)) * 1.5  # flat: nuclei of thousands
    p = (x - x.amax(dim=-1, keepdim=True)).exp()
    p = p.masked_fill(p < min_p, 0.0)
    threshold = _nucleus_threshold_by_histogram(p, torch.full((3,), top_p), _Scratch("cpu"))
    for i in range(3):
        ours = set(torch.nonzero(p[i] >= threshold[i]).flatten().tolist())
        kept = _hf_kept(x[i], 0, top_p, min_p)
        assert len(kept) > CANDIDATES
        assert ours == kept


def test_wide_nucleus_sampling_follows_the_renormalized_softmax():
    logits = torch.linspace(0.0, 3.0, 600)  # a nucleus of hundreds of tokens: the histogram path
    kept = sorted(_hf_kept(logits, 0, 0.9))
    assert len(kept) > CANDIDATES
    rows = 20000
    tokens = Sampler(torch.device("cpu"), seed=11)(logits.repeat(rows, 1), _meta([1.0] * rows, top_p=[0.9] * rows))
    assert set(tokens.tolist()) <= set(kept)
    expected = torch.zeros(600)
    expected[kept] = logits[kept].softmax(-1)
    groups = torch.tensor_split(torch.tensor(kept), 6)  # compare the mass of six slices of the kept set
    freq = torch.bincount(tokens, minlength=600).float() / rows
    for g in groups:
        e, f = expected[g].sum(), freq[g].sum()
        assert abs(f - e) <= 4 * (e * (1 - e) / rows) ** 0.5, (f, e)


def test_top_k_sampling_frequencies_follow_the_renormalized_softmax():
    base = torch.tensor([3.0, 2.0, 1.5, 1.0, 0.0, -1.0])
    rows = 20000
    tokens = Sampler(torch.device("cpu"), seed=5)(base.repeat(rows, 1), _meta([1.0] * rows, top_k=[3] * rows))
    freq = torch.bincount(tokens, minlength=6).float() / rows
    expected = torch.zeros(6)
    expected[:3] = base[:3].softmax(-1)
    tol = 4 * (expected * (1 - expected) / rows).sqrt() + 1e-6
    assert ((freq - expected).abs() <= tol).all(), (freq, expected)


LARGE = 20000  # 312 tiles of 64 and a tail of 32: the candidates come from tiles (tiles.py)


@pytest.mark.parametrize(
    "top_k, top_p, min_p",
    [(0, 0.5, 0.0), (0, 0.95, 0.0), (40, 1.0, 0.0), (40, 0.8, 0.05), (5, 0.3, 0.1), (300, 0.9, 0.0)],
)
def test_large_vocab_samples_inside_hf_kept_set(top_k, top_p, min_p):
    logits = _logits(4, seed=12, vocab=LARGE) / 3  # flat rows: nuclei of thousands (the histogram)
    logits[:2, [7, 19990, 19999]] += 12  # peaked rows, their peak in the tail too: nuclei among the candidates
    for i, seen in enumerate(_support(logits, top_k, top_p, min_p, draws=100)):
        kept = _hf_kept(logits[i], top_k, top_p, min_p)
        assert seen <= kept
        if len(kept) <= 3:
            assert seen == kept


def test_large_vocab_greedy_rows_take_torchs_argmax():
    logits = torch.randint(-4, 4, (6, LARGE), generator=torch.Generator().manual_seed(13)).float()  # ties
    logits[1, -5] = 9.0  # in the tail
    out = Sampler(torch.device("cpu"), seed=0)(logits, _meta([0.0, 0.0, 1.0, 0.0, 0.7, 0.0], top_k=[0, 0, 5, 0, 0, 0]))
    greedy = [0, 1, 3, 5]
    assert torch.equal(out[greedy], logits[greedy].argmax(dim=-1))


def test_top_k_frequencies_over_tiles_follow_the_renormalized_softmax():
    base = torch.randn(4100, generator=torch.Generator().manual_seed(14))  # 64 tiles and a tail of 4
    base[[5, 70, 4097]] += 4.0
    rows = 4000
    tokens = Sampler(torch.device("cpu"), seed=15)(base.repeat(rows, 1), _meta([1.0] * rows, top_k=[20] * rows))
    top = base.topk(20).indices
    assert set(tokens.tolist()) <= set(top.tolist())
    expected = base[top].softmax(-1)
    freq = torch.bincount(tokens, minlength=len(base))[top].float() / rows
    tol = 4 * (expected * (1 - expected) / rows).sqrt() + 1e-6
    assert ((freq - expected).abs() <= tol).all(), (freq, expected)


@pytest.mark.parametrize("top_k, top_p", [(3, 1.0), (0, 0.9)])
def test_large_vocab_nan_is_never_drawn_inf_wins_and_banned_rows_take_token_0(top_k, top_p):
    x = torch.full((4, LARGE), -30.0)  # the rest: never drawn in practice
    x[0, [10, 15000]] = torch.tensor([1.0, 0.5])
    x[0, [3, 9000, 19999]] = float("nan")
    x[1] = float("-inf")
    x[2, [4, 500]] = torch.tensor([float("inf"), 2.0])
    x[3, [12, 19995]] = torch.tensor([0.0, 1.0])  # a finite row in a batch that has non-finite ones
    x = x.repeat(30, 1)
    rows = len(x)
    tokens = Sampler(torch.device("cpu"), seed=16)(x, _meta([0.7] * rows, top_k=[top_k] * rows, top_p=[top_p] * rows))
    tokens = tokens.view(30, 4)
    assert set(tokens[:, 0].tolist()) == {10, 15000}
    assert (tokens[:, 1] == 0).all() and (tokens[:, 2] == 4).all()
    assert set(tokens[:, 3].tolist()) <= {12, 19995}


def test_a_sampler_reused_over_steps_draws_as_a_fresh_one():
    """The torch path keeps its large temporaries from step to step (and grows them): seeded draws of a reused
    sampler must be those of a new one, whatever the batches before."""
    reused = Sampler(torch.device("cpu"), seed=0)
    for step, n in enumerate([3, 9, 5, 12, 2]):
        logits = _logits(n, seed=20 + step, vocab=LARGE) / (1 + step % 3)
        meta = _meta(
            [[0.0, 1.0, 0.8, 1.3][i % 4] for i in range(n)],
            top_k=[[0, 0, 40, 0, 7][i % 5] for i in range(n)],
            top_p=[[1.0, 0.9, 0.95, 0.5][i % 4] for i in range(n)],
            min_p=[[0.0, 0.05][i % 2] for i in range(n)],
            seeds={i: 100 + i for i in range(n)},
            positions={i: step for i in range(n)},
        )
        fresh = Sampler(torch.device("cpu"), seed=1)
        assert torch.equal(reused(logits, meta), fresh(logits, meta))


def test_each_path_runs_where_it_should(sampling_path):
    meta = _meta([0.0, 1.0], top_k=[0, 5])
    assert (meta.params is not None) == sampling_path.startswith("c")
    assert (meta.sample_rows is not None) == (sampling_path == "torch")


def test_low_top_p_sampling_follows_the_renormalized_softmax():
    """A flat row whose nucleus holds a third of the mass: most first draws fall outside it (the C kernels redraw)."""
    logits = torch.linspace(0.0, 1.0, 3000)
    kept = sorted(_hf_kept(logits, 0, 0.3))
    rows = 20000
    tokens = Sampler(torch.device("cpu"), seed=17)(logits.repeat(rows, 1), _meta([1.0] * rows, top_p=[0.3] * rows))
    assert set(tokens.tolist()) <= set(kept)
    expected = torch.zeros(3000)
    expected[kept] = logits[kept].softmax(-1)
    freq = torch.bincount(tokens, minlength=3000).float() / rows
    for g in torch.tensor_split(torch.tensor(kept), 5):
        e, f = expected[g].sum(), freq[g].sum()
        assert abs(f - e) <= 4 * (e * (1 - e) / rows) ** 0.5, (f, e)
