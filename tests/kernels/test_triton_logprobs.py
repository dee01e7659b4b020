"""The Triton logprobs kernel against a float64 log-softmax: the chosen token's logprob and rank, the top-n tokens in
order with theirs; with banned tokens, a maximum in the last tile, and many equal logits (the exact search). Without
CUDA the kernel runs in Triton's interpreter (see conftest.py)."""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("triton")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
logprobs = importlib.import_module("pagedllm.kernels.logprobs")
row_passes = importlib.import_module("pagedllm.kernels.row_passes")
if DEVICE.type == "cpu" and type(row_passes._tokens).__name__ != "InterpretedFunction":  # imported before it was on
    importlib.reload(row_passes)  # the helpers first, then the kernel that imports them
    logprobs = importlib.reload(logprobs)


@pytest.mark.parametrize("vocab", [50, 3000] + ([151_936] if DEVICE.type == "cuda" else []))
@pytest.mark.parametrize("num_top", [0, 1, 5, 20])
def test_logprobs_match_a_float64_log_softmax(vocab, num_top):
    g = torch.Generator().manual_seed(vocab + num_top)
    raw = torch.randn(6, vocab, generator=g) * 4
    raw[1, : vocab // 2] = float("-inf")  # banned tokens
    raw[2, -1] = 30.0  # the maximum in the last tile
    raw[3, 7 : 7 + min(200, vocab - 7)] = raw[3].max() + 1.0  # up to 200 equal largest logits: more than the list
    chosen = torch.randint(0, vocab, (6,), generator=g)
    chosen[0] = raw[0].argmax()
    chosen[1] = vocab - 1
    index = None
    if num_top % 2:  # the chosen tokens among others, picked by index
        pool = torch.randint(0, vocab, (9,), generator=g)
        index = torch.tensor([8, 0, 5, 1, 2, 7])
        pool[index] = chosen
        out = logprobs.logprobs(raw.to(DEVICE), pool.to(DEVICE), index.to(DEVICE), num_top).cpu()
    else:
        out = logprobs.logprobs(raw.to(DEVICE), chosen.to(DEVICE), None, num_top).cpu()
    assert out.shape == (6, 3 + 2 * num_top)
    assert torch.equal(out[:, 0], chosen.int())
    ranks, lp = out[:, 1], out[:, 2].contiguous().view(torch.float32)
    top_ids, top_lp = out[:, 3 : 3 + num_top], out[:, 3 + num_top :].contiguous().view(torch.float32)
    ref = raw.double().log_softmax(dim=-1)
    for i in range(6):
        c = int(chosen[i])
        assert int(ranks[i]) == 1 + int((raw[i] > raw[i, c]).sum())
        assert float(lp[i]) == pytest.approx(float(ref[i, c]), abs=1e-4)
        ids = top_ids[i].tolist()
        assert len(set(ids)) == num_top
        assert torch.equal(raw[i, ids], raw[i].topk(num_top).values)  # the largest, in order
        if i == 3:  # among equal values the lowest tokens come first
            assert ids == list(range(7, 7 + num_top))
        torch.testing.assert_close(top_lp[i].double(), ref[i, ids], atol=1e-4, rtol=0)
