"""The CPU logprobs of the sampled tokens (logsumexp and ranks in blocks of rows, the top-k through tiles) against a
float64 log-softmax."""

from __future__ import annotations

import pytest
import torch

from pagedllm.worker.sample_inputs import logprob_rows, logprob_tensors


@pytest.fixture(autouse=True)
def _paths(sampling_path):
    """Every test here runs on each CPU sampling path."""


@pytest.mark.parametrize("vocab", [50, 20000])  # 20000: the top-k through tiles, with a tail
def test_logprobs_match_a_float64_log_softmax(vocab):
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(40, vocab, generator=g) * 4
    raw[3, : vocab // 2] = float("-inf")  # banned tokens
    raw[5, -1] = 30.0  # the maximum in the tail
    num_top = [None if i % 4 == 1 else i % 6 for i in range(len(raw))]  # 0 to 5, some rows none
    sampled = torch.randint(0, vocab, (len(raw),), generator=g)
    sampled[::3] = raw[::3].argmax(dim=-1)  # rank 1
    sampled[5] = vocab - 1
    rows = logprob_rows(raw, num_top)
    out = logprob_tensors(rows, sampled, num_top).tolists()
    ref = raw.double().log_softmax(dim=-1)
    for i, entry in enumerate(out):
        if num_top[i] is None:
            assert entry is None
            continue
        ids, lps, ranks = entry
        chosen = int(sampled[i])
        assert ids[0] == chosen and ranks[0] == 1 + int((raw[i] > raw[i, chosen]).sum())
        assert lps[0] == pytest.approx(float(ref[i, chosen]), abs=1e-4)
        top = ids[1:]
        assert len(top) == num_top[i] and len(set(top)) == len(top)
        assert torch.equal(raw[i, top], raw[i].topk(num_top[i]).values)
        assert lps[1:] == pytest.approx(ref[i, top].tolist(), abs=1e-4)
        assert ranks[1:] == list(range(1, num_top[i] + 1))
