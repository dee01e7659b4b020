"""The sampler's C kernels (pagedllm/kernels/cpu_sampling.c) with chosen uniform numbers: the kept sets against HF
transformers' warpers, each draw against a float64 inverse CDF, non-finite logits, and the logprobs against a float64
log-softmax. Each test runs on the kernels as built here and without AVX-512."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sampling_reference import hf_kept

from pagedllm.kernels import cpu_sampling


@pytest.fixture(autouse=True)
def _builds(c_build):
    """Each test runs on the kernels as built here and as built without AVX-512."""


def _sample(x: torch.Tensor, t: float, k: int, p: float, min_p: float, u: np.ndarray):
    params = torch.tensor([[t, k, p, min_p]] * len(x), dtype=torch.float32)
    kept = np.zeros(len(x), dtype=np.int64)
    tokens = cpu_sampling.sample(x, params, u.astype(np.float32), cpu_sampling.Scratch(), kept)
    return tokens, kept


def _rows(vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=g)
    x[:2] *= 3  # peaked-ish
    x[2:4] /= 3  # flat: nuclei of thousands
    x[4:, [5, vocab - 3, vocab - 1]] += 12  # a few tokens hold almost all the mass, two in the last partial block
    return x


CASES = [(1.0, 0, 0.9, 0.0), (0.7, 0, 0.5, 0.0), (1.0, 40, 1.0, 0.0), (1.3, 40, 0.8, 0.05), (1.0, 5, 0.3, 0.1),
         (1.0, 300, 0.9, 0.0), (0.6, 0, 0.95, 0.02), (1.0, 0, 1.0, 0.05), (1.0, 1000, 1.0, 0.0)]  # fmt: skip


def _nucleus_bounds(x: torch.Tensor, t: float, k: int, p: float, min_p: float) -> tuple[list[int], int, int]:
    """After HF's min-p and top-k: the tokens by probability, descending, and how many top-p keeps at least and at
    most when its cut is read in float64 within float32 rounding (1e-5 of the mass): on flat rows with nuclei of
    thousands of tokens, float32 sums in two orders can put the cut a token apart."""
    keep = hf_kept(x, t, k, 1.0, min_p)
    w = torch.where(keep, (x.double() / t).softmax(-1), 0.0)
    order = sorted(torch.nonzero(keep).flatten().tolist(), key=lambda j: -float(w[j]))
    before = torch.cat([torch.zeros(1, dtype=torch.float64), w[order].cumsum(-1)[:-1]])
    target = p * float(w.sum()) if p < 1 else float("inf")
    slack = 1e-5 * float(w.sum())
    return order, int((before < target - slack).sum()), int((before < target + slack).sum())


@pytest.mark.parametrize("vocab", [1000, 20000, 49152 + 77])  # 49229: a partial last block and tile
@pytest.mark.parametrize("t, k, p, min_p", CASES)
def test_kept_sets_are_hfs_and_every_draw_lies_in_them(vocab, t, k, p, min_p):
    x = _rows(vocab)
    if k >= vocab:
        pytest.skip("top-k off")
    seen = [set() for _ in x]
    for d in range(25):
        tokens, kept = _sample(x, t, k, p, min_p, np.random.default_rng(d).random(len(x)))
        for i, token in enumerate(tokens.tolist()):
            seen[i].add(token)
    for i in range(len(x)):
        ref = set(torch.nonzero(hf_kept(x[i], t, k, p, min_p)).flatten().tolist())
        order, least, most = _nucleus_bounds(x[i], t, k, p, min_p)
        assert least <= len(ref) <= most  # HF's cut, in float32, is one of them
        if least == most:
            assert kept[i] == len(ref) and seen[i] <= ref
        else:
            assert least <= kept[i] <= most and seen[i] <= set(order[:most])


@pytest.mark.parametrize("vocab", [1000, 49152 + 77])
@pytest.mark.parametrize("t, k, min_p", [(1.0, 0, 0.0), (0.8, 0, 0.05), (1.0, 50, 0.0), (1.2, 7, 0.02)])
def test_each_draw_is_the_inverse_cdf_of_its_uniform(vocab, t, k, min_p):
    """Without top-p a row's token is the first, in token order, whose running weight exceeds u of the kept total."""
    x = _rows(vocab)
    u = np.random.default_rng(1).random((40, len(x)))
    for draw in u:
        tokens, _ = _sample(x, t, k, 1.0, min_p, draw)
        for i in range(len(x)):
            keep = hf_kept(x[i], t, k, 1.0, min_p)
            w = torch.where(keep, (x[i].double() / t).softmax(-1), 0.0)
            cum = w.cumsum(-1) / w.sum()
            expected = int(torch.searchsorted(cum, torch.tensor([float(draw[i])], dtype=torch.float64), right=True))
            near = (cum - draw[i]).abs().min() < 1e-5  # within float32 rounding of a boundary
            assert tokens[i] == expected or near


def test_nan_is_never_drawn_inf_wins_and_banned_rows_take_token_0():
    vocab = 3000
    x = torch.full((4, vocab), -30.0)
    x[0, [10, 2999]] = torch.tensor([1.0, 0.5])
    x[0, [3, 1500, 2998]] = float("nan")
    x[1] = float("-inf")
    x[2, [4, 500, 2995]] = torch.tensor([float("inf"), 2.0, float("inf")])
    x[3, 7] = 3.0e38  # x / T overflows to +inf
    for k, p in [(0, 1.0), (3, 1.0), (0, 0.9), (5, 0.5)]:
        seen = [set() for _ in x]
        for d in range(60):
            tokens, _ = _sample(x, 0.5, k, p, 0.0, np.random.default_rng(d).random(len(x)))
            for i, token in enumerate(tokens.tolist()):
                seen[i].add(token)
        assert seen[0] == {10, 2999} if p == 1.0 and k != 1 else seen[0] <= {10, 2999}
        assert seen[1] == {0} and seen[2] == {4, 2995} and seen[3] == {7}


@pytest.mark.parametrize("vocab", [37, 1000, 20000 + 5])
def test_greedy_rows_take_torchs_argmax(vocab):
    g = torch.Generator().manual_seed(2)
    x = torch.randint(-3, 3, (8, vocab), generator=g).float()  # ties everywhere
    x[1, -1] = 9.0  # in the tail
    x[2, [1, vocab - 2]] = float("nan")  # NaN counts as the largest: the first NaN, before the largest number
    x[2, vocab // 2] = 100.0
    x[3] = float("-inf")
    x[4, :] = 5.0
    x[5, vocab // 3] = float("inf")
    tokens, _ = _sample(x, 0.0, 0, 1.0, 0.0, np.zeros(len(x)))
    assert torch.equal(tokens, x.argmax(dim=-1))
    # bfloat16 rows read as they are: every value above is a bfloat16 value, so the float32 rows are their exact copy
    rows = x.bfloat16()
    torch.testing.assert_close(rows.float(), x, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(cpu_sampling.argmax_bf16(rows), x.argmax(dim=-1))
    assert torch.equal(cpu_sampling.argmax_bf16(rows[:, : vocab - 1]), x[:, : vocab - 1].argmax(dim=-1))  # strided


@pytest.mark.parametrize("vocab", [1, 300, 49152])
def test_bfloat16_argmax_is_the_argmax_of_the_float32_copy(vocab):
    g = torch.Generator().manual_seed(vocab)
    rows = (torch.randn(64, vocab, generator=g) * 4).bfloat16()  # bfloat16's coarse values: ties too
    assert torch.equal(cpu_sampling.argmax_bf16(rows), rows.float().argmax(dim=-1))


@pytest.mark.parametrize("vocab", [50, 20000 + 37])
@pytest.mark.parametrize("num_top", [0, 1, 5, 20])
def test_logprobs_match_a_float64_log_softmax(vocab, num_top):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(12, vocab, generator=g) * 4
    x[1, : vocab // 2] = float("-inf")
    x[2, -1] = 40.0  # the largest in the tail
    x[3, [0, 7]] = float("nan")  # counts as -inf
    x[4, :10] = 1.0  # ties among the top: the lower token first
    x[4, 10:] = -1.0
    chosen = torch.randint(0, vocab, (len(x),), generator=g)
    chosen[2], chosen[3] = vocab - 1, 7
    addresses = x.data_ptr() + np.arange(len(x)) * x.stride(0) * 4
    lp, ranks, top_ids, top_lp = cpu_sampling.logprobs(addresses, vocab, chosen, num_top, cpu_sampling.Scratch())
    clean = x.nan_to_num(nan=float("-inf"), posinf=float("inf"))
    ref = clean.double().log_softmax(dim=-1)
    for i in range(len(x)):
        c = int(chosen[i])
        assert ranks[i] == 1 + int((clean[i] > clean[i, c]).sum())
        assert float(lp[i]) == pytest.approx(float(ref[i, c]), abs=1e-4)
        order = sorted(range(vocab), key=lambda j: (-float(clean[i, j]), j))[:num_top]
        assert top_ids[i].tolist() == order
        assert top_lp[i].tolist() == pytest.approx(ref[i, order].tolist(), abs=1e-4)
