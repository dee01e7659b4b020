"""The vectorized sampler against HF transformers' logits processors and plain re-implementations."""

from __future__ import annotations

import pytest
import torch
from transformers import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from pagedllm.sample.sampler import Sampler, SamplingMetadata, apply_min_p, apply_top_k_top_p

VOCAB = 1000


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _meta(temperature, top_k=None, top_p=None, min_p=None, generators=None) -> SamplingMetadata:
    t = torch.tensor(temperature, dtype=torch.float32)
    return SamplingMetadata(
        temperature=t,
        all_greedy=bool((t < 1e-5).all()),
        top_k=None if top_k is None else torch.tensor(top_k),
        top_p=None if top_p is None else torch.tensor(top_p, dtype=torch.float32),
        min_p=None if min_p is None else torch.tensor(min_p, dtype=torch.float32),
        generators=generators or {},
    )


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
def test_seeded_row_is_independent_of_its_batch(position):
    logits = _logits(4, seed=8)
    row = logits[1].clone()

    def draw(batch: torch.Tensor, at: int) -> int:
        gen = torch.Generator().manual_seed(42)
        sampler = Sampler(torch.device("cpu"), seed=at + 100)  # a different unseeded stream each time
        return int(sampler(batch, _meta([1.0] * len(batch), generators={at: gen}))[at])

    alone = draw(row[None, :], 0)
    mixed = logits.clone()
    mixed[position] = row
    assert draw(mixed, position) == alone


@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (0, 0.5), (40, 1.0), (40, 0.8), (1, 0.3)])
def test_candidate_filter_keeps_the_same_tokens_as_the_full_filter(top_k, top_p):
    from pagedllm.sample.sampler import _candidate_rows, _filter_candidates

    logits = _logits(6, seed=9)
    logits[:, :3] += 8  # peaked rows: their nucleus lies among the top candidates
    k, p = torch.full((6,), top_k), torch.full((6,), top_p)
    fast, vals, ids, _ = _candidate_rows(logits, k, p)
    assert fast.all()
    kept = _filter_candidates(vals, k, p, logits.logsumexp(dim=-1))
    full = apply_top_k_top_p(logits, k if top_k else None, p if top_p < 1 else None)
    for i in range(6):
        assert set(ids[i][torch.isfinite(kept[i])].tolist()) == set(
            torch.nonzero(torch.isfinite(full[i])).flatten().tolist()
        )


def test_top_k_sampling_frequencies_follow_the_renormalized_softmax():
    base = torch.tensor([3.0, 2.0, 1.5, 1.0, 0.0, -1.0])
    rows = 20000
    tokens = Sampler(torch.device("cpu"), seed=5)(base.repeat(rows, 1), _meta([1.0] * rows, top_k=[3] * rows))
    freq = torch.bincount(tokens, minlength=6).float() / rows
    expected = torch.zeros(6)
    expected[:3] = base[:3].softmax(-1)
    tol = 4 * (expected * (1 - expected) / rows).sqrt() + 1e-6
    assert ((freq - expected).abs() <= tol).all(), (freq, expected)
