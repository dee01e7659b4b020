"""The CPU logprobs of the sampled tokens (C kernels, or torch ops: logsumexp and ranks in blocks of rows, the top-k
through tiles) against a float64 log-softmax."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.sample.logprobs import logprob_rows, logprob_tensors


@pytest.fixture(autouse=True)
def _paths(sampling_path):
    """Every test here runs on each CPU sampling path."""


def _wanted_entries(out, raw, sampled, num_top):
    """Asserts each row's entry: None where no logprobs are wanted, else the sampled token first, with its rank in
    raw and its float64 log-softmax logprob. Yields (row, top ids, top logprobs, top ranks, the log-softmax) of the
    wanted rows."""
    ref = raw.double().log_softmax(dim=-1)
    for i, entry in enumerate(out):
        if num_top[i] < 0:
            assert entry is None
            continue
        ids, lps, ranks = entry
        chosen = int(sampled[i])
        assert ids[0] == chosen and ranks[0] == 1 + int((raw[i] > raw[i, chosen]).sum())
        assert lps[0] == pytest.approx(float(ref[i, chosen]), abs=1e-4)
        yield i, ids[1:], lps[1:], ranks[1:], ref


@pytest.mark.parametrize("vocab", [50, 20000])  # 20000: the top-k through tiles, with a tail
def test_logprobs_match_a_float64_log_softmax(vocab):
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(40, vocab, generator=g) * 4
    raw[3, : vocab // 2] = float("-inf")  # banned tokens
    raw[5, -1] = 30.0  # the maximum in the tail
    num_top = np.array([-1 if i % 4 == 1 else i % 6 for i in range(len(raw))])  # 0 to 5, some rows none (-1)
    sampled = torch.randint(0, vocab, (len(raw),), generator=g)
    sampled[::3] = raw[::3].argmax(dim=-1)  # rank 1
    sampled[5] = vocab - 1
    rows = logprob_rows(raw, num_top)
    out = logprob_tensors(rows, sampled, num_top).tolists()
    for i, top, top_lps, top_ranks, ref in _wanted_entries(out, raw, sampled, num_top):
        assert len(top) == num_top[i] and len(set(top)) == len(top)
        assert torch.equal(raw[i, top], raw[i].topk(num_top[i]).values)
        assert top_lps == pytest.approx(ref[i, top].tolist(), abs=1e-4)
        assert top_ranks == list(range(1, num_top[i] + 1))


def test_logprobs_read_the_rows_as_they_were_before_adjust_logits_changed_them():
    """Rows that adjust_logits changes are kept as copies; the others may be read in place after sampling."""
    g = torch.Generator().manual_seed(1)
    raw = torch.randn(8, 3000, generator=g) * 3
    before = raw.clone()
    num_top = np.array([2, -1, 3, 1, -1, 2, 4, 0])
    adjusted = np.array([True, True, False, True, False, False, True, False])
    rows = logprob_rows(raw, num_top, adjusted)
    raw[adjusted] = raw[adjusted] * 0.5 - 1.0  # what penalties might do, in place
    sampled = torch.randint(0, 3000, (8,), generator=g)
    out = logprob_tensors(rows, sampled, num_top).tolists()
    for i, top, _, _, _ in _wanted_entries(out, before, sampled, num_top):
        assert top == before[i].topk(num_top[i]).indices.tolist()
