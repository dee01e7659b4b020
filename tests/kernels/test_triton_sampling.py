"""The Triton sampler kernel for plain rows against the distribution it must draw from: softmax(x / T), renormalized
over the tokens min-p keeps (torch on CPU, and the reference min-p filter of tests/sample). Without CUDA the kernel
runs in Triton's interpreter (see conftest.py), slowly: a few hundred draws over a two-tile vocabulary (block 16);
on CUDA the same tests draw far more and the gpu-marked ones use the real block and vocabulary size."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from pagedllm.sample.sampler import Sampler, SamplingMetadata, seeded_key

stats = pytest.importorskip("scipy.stats")
pytest.importorskip("triton")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
GPU = DEVICE.type == "cuda"
BLOCK = 4096 if GPU else 16  # the interpreter runs every op of every program in Python: keep the tiles tiny

sampling = importlib.import_module("pagedllm.kernels.sampling")
if not GPU and type(sampling.sample_plain_kernel).__name__ != "InterpretedFunction":
    sampling = importlib.reload(sampling)  # imported before the interpreter was switched on


def draw(logits, temperature, keys, min_p=None, rows=None, block=BLOCK) -> torch.Tensor:
    """The kernel's tokens for the given batch rows of logits [batch, vocab] (default all), one draw each; the other
    entries of the output stay -1."""
    batch = logits.shape[0]
    rows = torch.arange(batch) if rows is None else torch.as_tensor(rows)
    n = len(rows)
    out = torch.full((batch,), -1, dtype=torch.int64, device=DEVICE)
    sampling.sample_plain(
        logits.to(DEVICE),
        rows.to(DEVICE),
        torch.arange(n, device=DEVICE),
        torch.as_tensor(temperature, dtype=torch.float32).expand(n).contiguous().to(DEVICE),
        torch.as_tensor(keys, dtype=torch.int64).to(DEVICE),
        None if min_p is None else torch.as_tensor(min_p, dtype=torch.float32).expand(n).contiguous().to(DEVICE),
        out,
        block=block,
    )
    return out.cpu()


def random_keys(n: int, seed: int) -> torch.Tensor:
    return torch.randint(1 << 62, (n,), generator=torch.Generator().manual_seed(seed))


def expected_probs(x: torch.Tensor, temperature: float, min_p: float = 0.0) -> torch.Tensor:
    """softmax(x / T) over the tokens with p >= min_p * max p, renormalized. x [vocab] -> [vocab] float64"""
    p = (x.double() / temperature).softmax(-1)
    p = torch.where(p >= min_p * p.max(), p, 0.0)
    return p / p.sum()


def pearson_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's chi-square test of counts against expected counts, cells expected below 5 pooled into one."""
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum()[None]]).double()
    exp = torch.cat([expected[~small], expected[small].sum()[None]]).double()
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    assert len(obs) >= 3
    stat = float(((obs - exp) ** 2 / exp).sum())
    return float(stats.chi2.sf(stat, len(obs) - 1))


def chi_square_pvalue(tokens: torch.Tensor, p: torch.Tensor) -> float:
    """The test of the drawn tokens against probabilities p [vocab]; a token of probability 0 must never come."""
    counts = torch.bincount(tokens, minlength=len(p)).double()
    assert counts[p == 0].sum() == 0, "a token of probability 0 was drawn"
    return pearson_pvalue(counts, p * len(tokens))


def logits_over_two_tiles() -> torch.Tensor:
    """20 tokens (a block of 16 and a partial one), with mass in every quarter of the first tile and in the second."""
    x = torch.full((20,), -3.0)
    x[[1, 6, 9, 14, 17, 19]] = torch.tensor([1.0, 0.2, 0.6, -0.4, 0.9, 0.0])
    return x


@pytest.mark.parametrize("min_p", [None, 0.5])
def test_frequencies_follow_the_softmax(min_p):
    x, temperature = logits_over_two_tiles(), 0.7
    n = 100_000 if GPU else 300
    tokens = draw(x.expand(n, -1), temperature, random_keys(n, 1), min_p=min_p)
    p = expected_probs(x, temperature, min_p or 0.0)
    assert chi_square_pvalue(tokens, p) > 1e-3
    if min_p:  # the cut: p >= min_p * max p keeps exactly these
        assert set(tokens.tolist()) <= {1, 17, 9}


def test_temperature_and_batch_rows_per_row():
    """Each drawn row uses its own temperature and writes its own batch row; other rows stay untouched."""
    x = logits_over_two_tiles()
    n = 20_000 if GPU else 200
    logits = torch.stack([x, -x]).repeat(n, 1)  # [2n, vocab]: rows alternate x and -x
    rows = torch.arange(1, 2 * n, 2)  # the -x rows only
    tokens = draw(logits, 2.0, random_keys(n, 2), rows=rows)
    assert (tokens[0::2] == -1).all()
    assert chi_square_pvalue(tokens[1::2], expected_probs(-x, 2.0)) > 1e-3


def test_seeded_rows_draw_the_same_token_alone_and_in_another_batch():
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(3))
    keys = torch.from_numpy(seeded_key(np.array([7, 7, 7, 11, 11, 99]), np.array([0, 1, 2, 0, 1, 5])))
    together = draw(x, 1.0, keys)
    alone = torch.stack([draw(x[i : i + 1], 1.0, keys[i : i + 1])[0] for i in range(6)])
    assert torch.equal(together, alone)
    order = torch.tensor([5, 2, 0, 4, 1, 3])  # another batch: reordered, next to other rows
    mixed = torch.cat([torch.randn(2, 40), x[order]])
    shuffled = draw(mixed, 1.0, torch.cat([random_keys(2, 4), keys[order]]))
    assert torch.equal(shuffled[2:], together[order])


def test_nan_is_never_drawn_and_inf_wins():
    nan, inf = float("nan"), float("inf")
    rows = [
        [nan, nan, 0.5, nan, nan, nan, nan, nan, nan, nan, nan, nan, nan, nan, nan, nan, nan, nan],  # the finite one
        [nan, -inf, -inf, nan, nan, nan, nan, nan, nan, nan, nan, nan, nan, nan, nan, nan, nan, 3.0],
        [-inf] * 18,  # every token banned: token 0, as the argmax of the row
        [nan] * 17 + [-inf],  # NaN and -inf only: banned too
        [1.0, 2.0, 3.0, 4.0, 5.0, inf, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 16.0, 17.0],
        [0.0] * 16 + [inf, 1e30],  # +inf in the second tile beats the largest finite value
    ]
    x = torch.tensor(rows).repeat(8, 1)  # 8 draws of each row
    for min_p in (None, 0.1):
        tokens = draw(x, 0.5, random_keys(len(x), 5), min_p=min_p).view(8, len(rows))
        assert (tokens == torch.tensor([2, 17, 0, 0, 5, 16])).all(), tokens


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy: the overflow and log(0) are meant
def test_min_p_zero_keeps_every_token_and_overflowing_logits_win():
    x = torch.tensor([[1e38, 1.0, -1e38] + [0.0] * 13, [-3.0] * 15 + [-2.5]])
    temperature = torch.tensor([1e-3, 1.0]).repeat(20)  # row 0: 1e38 / 1e-3 overflows to +inf, the largest float
    tokens = draw(x.repeat(20, 1), temperature, random_keys(40, 6), min_p=[0.0] * 40).view(20, 2)
    assert (tokens[:, 0] == 0).all()
    assert tokens[:, 1].unique().numel() > 1  # min_p 0 drops nothing: not always the top token


@pytest.mark.gpu
def test_full_vocabulary_frequencies_on_the_gpu():
    """A Qwen-sized row (151,936 tokens, the real block) at temperature 0.6, 400,000 draws: chi-square over the 40
    most likely tokens one by one and the rest in 20 groups of equal expected mass, with and without min-p."""
    vocab, n, temperature, head = 151_936, 400_000, 0.6, 40
    x = torch.randn(vocab, generator=torch.Generator().manual_seed(7)) * 1.5
    x[torch.randperm(vocab, generator=torch.Generator().manual_seed(8))[:head]] += 6.0  # 40 likely tokens
    logits = x.to(DEVICE)[None, :].expand(n, vocab)  # stride 0: every program reads the same row
    for min_p in (None, 1e-3):  # min-p 1e-3 keeps 68 tokens
        tokens = draw(logits, temperature, random_keys(n, 9), min_p=min_p, block=sampling._BLOCK)
        p = expected_probs(x, temperature, min_p or 0.0)
        order = p.argsort(descending=True)
        counts = torch.bincount(tokens, minlength=vocab).double()[order]
        expected = p[order] * n
        assert counts[expected == 0].sum() == 0, "a token of probability 0 was drawn"
        tail = expected[head:].cumsum(0)
        group = (tail / tail[-1] * 20).long().clamp_(max=19)  # [vocab - head]: 20 groups of equal mass
        obs = torch.cat([counts[:head], torch.zeros(20, dtype=torch.float64).index_add_(0, group, counts[head:])])
        exp = torch.cat([expected[:head], torch.zeros(20, dtype=torch.float64).index_add_(0, group, expected[head:])])
        assert pearson_pvalue(obs, exp) > 1e-3, min_p


@pytest.mark.gpu
def test_sampler_plain_rows_on_the_gpu_never_sync_and_keep_seeds():
    """The Sampler's GPU plain path: no host sync (CUDA's sync debug mode raises on one), seeded rows give the same
    tokens whatever shares the batch, greedy rows the argmax."""
    vocab = 151_936
    x = torch.randn(8, vocab, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(0)) * 2

    def meta(n, temperature, seeded_rows):
        seeds = np.arange(n, dtype=np.int64) + 1000
        return SamplingMetadata.build(
            np.array(temperature, dtype=np.float32),
            np.zeros(n, dtype=np.int64),
            np.ones(n, dtype=np.float32),
            np.full(n, 0.01, dtype=np.float32),
            seeds=seeds,
            seeded=np.isin(np.arange(n), seeded_rows),
            positions=np.full(n, 3, dtype=np.int64),
            device=DEVICE,
        )

    m = meta(8, [0.0, 0.6, 0.6, 1.0, 0.6, 0.6, 0.8, 0.6], [2, 5])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = Sampler(DEVICE, seed=1)(x, m)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out[0] == x[0].argmax()
    # row 5 alone (seed 1005, position 3, temperature 0.6) draws what it drew in the batch
    alone = SamplingMetadata.build(
        np.array([0.6], dtype=np.float32),
        np.zeros(1, dtype=np.int64),
        np.ones(1, dtype=np.float32),
        np.full(1, 0.01, dtype=np.float32),
        seeds=np.array([1005]),
        seeded=np.array([True]),
        positions=np.array([3]),
        device=DEVICE,
    )
    assert Sampler(DEVICE, seed=2)(x[5:6].clone(), alone)[0] == out[5]
