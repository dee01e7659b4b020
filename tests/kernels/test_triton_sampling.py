"""The Triton sampling kernel against the distribution it must draw from: softmax(x / T), renormalized over the
tokens that min-p, top-k and top-p keep (HF transformers' logits warpers decide which). Without CUDA the kernel runs
in Triton's interpreter (see conftest.py), slowly: a few hundred draws over a vocabulary of a few tiles (block 16 or
64); on CUDA the same tests draw far more and the gpu-marked ones use the real block and vocabulary size."""

from __future__ import annotations

import numpy as np
import pytest
import sampling_kernels
import torch
from sampling_reference import hf_kept

from pagedllm.kernels import sampling_inputs
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler

stats = pytest.importorskip("scipy.stats")
pytest.importorskip("triton")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
GPU = DEVICE.type == "cuda"
BLOCK = 4096 if GPU else 16  # the interpreter runs every op of every program in Python: keep the tiles tiny

sampling = sampling_kernels.load()[-1]


def draw(logits, temperature, seeds, min_p=0.0, top_k=0, top_p=1.0, block=BLOCK, cap=None, positions=0):
    """The kernel's token for each row of logits [batch, vocab]; parameters are one value or one per row, every row
    seeded by its seed (and position); cap: candidates listed per top-k row (default the kernel's)."""
    n = logits.shape[0]
    column = lambda v, dtype=np.float32: np.broadcast_to(np.asarray(v, dtype=dtype), (n,))  # noqa: E731
    params = sampling_inputs.pack_params(
        column(temperature), column(top_k), column(top_p), column(min_p), column(seeds, np.int64),
        np.ones(n, dtype=bool), column(positions, np.int64),
    )  # fmt: skip
    cap = sampling._CAP if cap is None else cap
    inputs = sampling_kernels.device_inputs(params)
    return sampling.sample(logits.to(DEVICE), inputs, 0, block=block, cap=cap).cpu()


def random_seeds(n: int, seed: int) -> np.ndarray:
    """n random seeds."""
    return np.random.default_rng(seed).integers(-(2**63), 2**63 - 1, size=n, dtype=np.int64)


def expected_probs(x: torch.Tensor, temperature: float, min_p=0.0, top_k=0, top_p=1.0) -> torch.Tensor:
    """softmax(x / T) over the tokens HF keeps, renormalized. x [vocab] -> [vocab] float64"""
    p = (x.double() / temperature).softmax(-1).masked_fill(~hf_kept(x.double(), temperature, top_k, top_p, min_p), 0.0)
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


@pytest.mark.parametrize("min_p", [0.0, 0.5])
def test_frequencies_follow_the_softmax(min_p):
    x, temperature = logits_over_two_tiles(), 0.7
    n = 100_000 if GPU else 300
    tokens = draw(x.expand(n, -1), temperature, random_seeds(n, 1), min_p=min_p)
    p = expected_probs(x, temperature, min_p)
    assert chi_square_pvalue(tokens, p) > 1e-3
    if min_p:  # the cut: p >= min_p * max p keeps exactly these
        assert set(tokens.tolist()) <= {1, 17, 9}


FILTERS = [(3, 1.0, 0.0), (0, 0.6, 0.0), (5, 0.7, 0.0), (0, 0.9, 0.1), (4, 0.95, 0.05), (1, 1.0, 0.0), (40, 0.8, 0.0)]
MODES = {"sorted": (None, None), "searched": (None, 2), "row": (2, None)}  # (cap, small): see the test
# every filter in every mode on CUDA; in the interpreter (about 25 s a case) every filter once and every mode at least
# twice, the modes taken in turn
FILTER_CASES = [
    pytest.param(*f, *MODES[m], id=f"{m}-{'-'.join(map(str, f))}")
    for i, f in enumerate(FILTERS)
    for j, m in enumerate(MODES)
    if GPU or i % len(MODES) == j
]


@pytest.mark.parametrize("top_k, top_p, min_p, cap, small", FILTER_CASES)
def test_filters_keep_exactly_what_hf_keeps(top_k, top_p, min_p, cap, small, monkeypatch):
    """Over a few tiles of tokens (two tied near the top), no token HF drops is drawn, every kept one of some mass
    is, at the renormalized softmax's frequencies: with the candidates listed and sorted, listed but too many to sort
    (searched: lists of more than 2 entries), and too many to list (cap 2: the row itself is searched)."""
    if small is not None:
        monkeypatch.setattr(sampling, "_SMALL", small)
    x = torch.randn(37, generator=torch.Generator().manual_seed(top_k + int(100 * top_p))) * 1.2
    x[[3, 30]] = x.max() - 0.3  # a tie near the top
    temperature = 0.8
    p = expected_probs(x, temperature, min_p, top_k, top_p)
    n = 100_000 if GPU else 100
    tokens = draw(x.expand(n, -1), temperature, random_seeds(n, 11), min_p, top_k, top_p, BLOCK, cap)
    drawn = torch.bincount(tokens, minlength=len(x)) > 0
    assert not drawn[p == 0].any(), "a token HF drops was drawn"
    assert drawn[p >= 0.04].all(), "a token HF keeps was never drawn"
    if GPU and (p > 0).sum() >= 3:  # a chi-square test needs three cells
        assert chi_square_pvalue(tokens, p) > 1e-3


def test_rows_use_their_own_parameters():
    """Rows alternate x at temperature 2 with top-k 4, greedy rows (the argmax) and -x at temperature 0.5."""
    x = logits_over_two_tiles()
    n = 20_000 if GPU else 100
    logits = torch.stack([x, x, -x]).repeat(n, 1)  # [3n, vocab]
    temperature = torch.tensor([2.0, 0.0, 0.5]).repeat(n)
    top_k = torch.tensor([4, 0, 0]).repeat(n)
    tokens = draw(logits, temperature, random_seeds(3 * n, 2), top_k=top_k)
    assert (tokens[1::3] == x.argmax()).all()
    assert chi_square_pvalue(tokens[0::3], expected_probs(x, 2.0, top_k=4)) > 1e-3
    assert chi_square_pvalue(tokens[2::3], expected_probs(-x, 0.5)) > 1e-3


def test_seeded_rows_draw_the_same_token_alone_and_in_another_batch():
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(3))
    seeds, positions = np.array([7, 7, 7, 11, 11, 99]), np.array([0, 1, 2, 0, 1, 5])
    together = draw(x, 1.0, seeds, positions=positions)
    alone = torch.stack(
        [draw(x[i : i + 1], 1.0, seeds[i : i + 1], positions=positions[i : i + 1])[0] for i in range(6)]
    )
    assert torch.equal(together, alone)
    order = np.array([5, 2, 0, 4, 1, 3])  # another batch: reordered, next to other rows
    mixed = torch.cat([torch.randn(2, 40), x[order]])
    other = random_seeds(2, 4)
    shuffled = draw(mixed, 1.0, np.concatenate([other, seeds[order]]), positions=np.r_[0, 0, positions[order]])
    assert torch.equal(shuffled[2:], together[torch.from_numpy(order)])


def test_memory_gives_the_last_tensors_back_for_the_same_shapes():
    memory = sampling.Memory()
    a = memory.take("scratch", (100,), torch.device("cpu"))
    assert memory.take("scratch", (100,), torch.device("cpu")) is a
    b = memory.take("scratch", (60,), torch.device("cpu"))  # smaller: a view of the same memory
    assert b.data_ptr() == a.data_ptr() and b.shape == (60,)
    c = memory.take("scratch", (1000,), torch.device("cpu"))  # larger: new memory
    assert c.shape == (1000,) and c.dtype == torch.int32
    w = memory.take("work", (3, 8), torch.device("cpu"), torch.bfloat16)  # another use: memory of its own
    assert w.shape == (3, 8) and w.dtype == torch.bfloat16 and w.data_ptr() != c.data_ptr()


def test_memory_kept_between_launches_draws_as_new_memory():
    """Launches that share their working memory (lists, counts, penalized rows) draw what launches with new memory
    draw, whatever the launch before them left there."""
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randn(n, 40, generator=gen) * 3 for n in (6, 3, 6)]
    memory = sampling.Memory()
    for x in batches:
        n = x.shape[0]
        params = sampling_inputs.pack_params(
            np.full(n, 0.8, dtype=np.float32), np.array([3, 0, 5, 0, 2, 0][:n]), np.full(n, 0.9, dtype=np.float32),
            np.zeros(n, dtype=np.float32), random_seeds(n, n), np.ones(n, dtype=bool), np.arange(n),
        )  # fmt: skip
        inputs = sampling_kernels.device_inputs(params)
        shared = sampling.sample(x.to(DEVICE), inputs, 0, block=16, memory=memory)
        assert torch.equal(shared, sampling.sample(x.to(DEVICE), inputs, 0, block=16))


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="the compiled kernel's direct launch needs CUDA")
def test_direct_launch_draws_as_tritons_launch():
    """After Triton's first launch of a specialization, Launch calls the compiled kernel itself: same tokens."""
    from pagedllm.kernels.launch import Launch

    class Spy:  # counts the launches that go through Triton
        def __init__(self, kernel):
            self.kernel, self.through_triton = kernel, 0

        def __getattr__(self, name):
            return getattr(self.kernel, name)

        def __getitem__(self, grid):
            self.through_triton += 1
            return self.kernel[grid]

    launch = Launch(sampling.sample_kernel)
    assert launch.direct
    spy = launch.kernel = Spy(sampling.sample_kernel)
    x = torch.randn(64, 5000, device=DEVICE) * 3
    n = x.shape[0]
    params = sampling_inputs.pack_params(
        np.full(n, 0.7, dtype=np.float32), np.zeros(n, dtype=np.int64), np.full(n, 0.9, dtype=np.float32),
        np.zeros(n, dtype=np.float32), random_seeds(n, 1), np.ones(n, dtype=bool), np.arange(n),
    )  # fmt: skip
    inputs = sampling_kernels.device_inputs(params)
    expected = sampling.sample(x, inputs, 0)  # through the module's launcher
    original = sampling._launch
    try:
        sampling._launch = launch
        first, second = sampling.sample(x, inputs, 0), sampling.sample(x, inputs, 0)
    finally:
        sampling._launch = original
    assert torch.equal(first, expected) and torch.equal(second, expected)
    assert spy.through_triton == 0  # the module's launch had compiled and loaded this specialization


def test_draws_vary_with_seed_and_position():
    """Over a flat row of 16 tokens, the draws of 5 seeds (the extremes of 64 bits among them) x 40 positions are
    uniform: every (seed, position) keys its own numbers."""
    seeds = np.repeat(np.array([0, 1, -1, 2**63 - 1, -(2**63)], dtype=np.int64), 40)
    positions = np.tile(np.arange(40), 5)
    tokens = draw(torch.zeros(len(seeds), 16), 1.0, seeds, positions=positions)
    assert chi_square_pvalue(tokens, torch.full((16,), 1 / 16, dtype=torch.float64)) > 1e-3
    for i in range(5):  # each seed's positions alone, too
        assert len(set(tokens[40 * i : 40 * (i + 1)].tolist())) >= 8


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
    settings = ((0.5, 0.0, 0, 1.0), (0.5, 0.1, 0, 1.0), (0.5, 0.0, 3, 0.9), (0.0, 0, 0, 1))  # T, min-p, top-k, top-p
    for temperature, min_p, top_k, top_p in settings:
        tokens = draw(x, temperature, random_seeds(len(x), 5), min_p, top_k, top_p).view(8, len(rows))
        assert (tokens == torch.tensor([2, 17, 0, 0, 5, 16])).all(), (temperature, min_p, top_k, top_p, tokens)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy: the overflow and log(0) are meant
def test_min_p_zero_keeps_every_token_and_overflowing_logits_win():
    x = torch.tensor([[1e38, 1.0, -1e38] + [0.0] * 13, [-3.0] * 15 + [-2.5]])
    temperature = torch.tensor([1e-3, 1.0]).repeat(20)  # row 0: 1e38 / 1e-3 overflows to +inf, the largest float
    tokens = draw(x.repeat(20, 1), temperature, random_seeds(40, 6), min_p=[0.0] * 40).view(20, 2)
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
    for min_p in (0.0, 1e-3):  # min-p 1e-3 keeps 68 tokens
        tokens = draw(logits, temperature, random_seeds(n, 9), min_p=min_p, block=sampling._BLOCK)
        p = expected_probs(x, temperature, min_p)
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
@pytest.mark.parametrize("top_k, top_p, spread", [(50, 1.0, 2.0), (0, 0.9, 2.0), (20, 0.95, 2.0), (0, 0.8, 6.0)])
def test_filters_over_a_full_vocabulary_on_the_gpu(top_k, top_p, spread):
    """A 151,936-token row, flat (spread 2: a top-p nucleus of thousands of tokens, too many to list) or peaked: the
    drawn tokens lie in HF's kept set, and their frequencies follow the renormalized softmax (chi-square over 40
    groups of equal expected mass)."""
    vocab, n, temperature = 151_936, 200_000, 1.0
    x = torch.randn(vocab, generator=torch.Generator().manual_seed(12)) * spread
    tokens = draw(x.to(DEVICE)[None, :].expand(n, vocab), temperature, random_seeds(n, 13), 0.0, top_k, top_p)
    p = expected_probs(x, temperature, top_k=top_k, top_p=top_p)
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert counts[p == 0].sum() == 0, "a token HF drops was drawn"
    order = p.argsort(descending=True)
    mass = p[order].cumsum(0)
    group = (mass / mass[-1] * 40).long().clamp_(max=39)  # [vocab]: 40 groups of equal mass, most likely first
    obs = torch.zeros(40, dtype=torch.float64).index_add_(0, group, counts[order])
    exp = torch.zeros(40, dtype=torch.float64).index_add_(0, group, p[order] * n)
    assert pearson_pvalue(obs, exp) > 1e-3


@pytest.mark.gpu
def test_sampler_on_the_gpu_never_syncs_and_keeps_seeds():
    """The Sampler's GPU path over a mixed batch: no host sync (CUDA's sync debug mode raises on one), seeded rows
    give the same tokens whatever shares the batch, greedy rows the argmax."""
    vocab = 151_936
    x = torch.randn(8, vocab, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(0)) * 2

    def meta(temperature, top_k, top_p, seeded_rows, seeds=None):
        n = len(temperature)
        return SamplingMetadata.build(
            np.array(temperature, dtype=np.float32),
            np.array(top_k, dtype=np.int64),
            np.array(top_p, dtype=np.float32),
            np.full(n, 0.01, dtype=np.float32),
            seeds=np.arange(n, dtype=np.int64) + 1000 if seeds is None else np.array(seeds, dtype=np.int64),
            seeded=np.isin(np.arange(n), seeded_rows),
            positions=np.full(n, 3, dtype=np.int64),
            device=DEVICE,
        )

    temperature, top_p = [0.0, 0.6, 0.6, 1.0, 0.6, 0.6, 0.8, 0.6], [1, 1, 0.9, 0.8, 1, 0.95, 1, 1]
    m = meta(temperature, [0, 0, 20, 0, 5, 0, 0, 50], top_p, [2, 5])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = Sampler(DEVICE, seed=1)(x, m)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out[0] == x[0].argmax()
    # rows 2 and 5 alone (seeds 1002 and 1005, position 3) draw what they drew in the batch
    alone = meta([0.6, 0.6], [20, 0], [0.9, 0.95], [0, 1], seeds=[1002, 1005])
    assert torch.equal(Sampler(DEVICE, seed=2)(x[[2, 5]].clone(), alone), out[[2, 5]])


def test_negative_zero_ties_with_zero():
    """-0.0 and +0.0 are equal logits (their float bits differ): min-p 1 keeps a top of -0.0, and top-k 1 keeps both
    when they tie at the top."""
    x = torch.full((40, 20), -5.0)
    x[:, 3] = -0.0
    assert (draw(x, 1.0, random_seeds(40, 14), min_p=1.0) == 3).all()
    x[:, 4] = 0.0
    assert set(draw(x, 1.0, random_seeds(40, 15), top_k=1).tolist()) == {3, 4}
