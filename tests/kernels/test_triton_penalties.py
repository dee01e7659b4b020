"""The Triton penalties (inside the sampling kernel, on copies of the penalized rows) against the torch path (held to
HF's repetition penalty and the OpenAI formula in tests/sample/test_logits_processors.py). Without CUDA the kernels
run in Triton's interpreter (see conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest
import sampling_kernels
import torch

from pagedllm.kernels import sampling_inputs
from pagedllm.sample.logits_processors import apply_penalties

pytest.importorskip("triton")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
penalties, _, sampling = sampling_kernels.load()


@pytest.mark.parametrize("vocab", [50, 1000])
def test_sampling_kernel_penalizes_copies_as_the_torch_path(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(7, vocab, generator=gen) * 4
    lengths = np.array([(5, 12), (0, 0), (3, 3), (8, 600), (1, 2)])  # (prompt, all tokens) per penalized row
    token_ids = torch.randint(0, 6, (5, 600), generator=gen).numpy()  # few distinct tokens: many repeats
    token_ids[3, :400] = torch.randint(0, vocab, (400,), generator=gen).numpy()  # over two blocks of places
    rows = np.array([4, 0, 2, 6, 1])
    rep = np.array([1.3, 0.7, 2.0, 1.1, 1.0], dtype=np.float32)
    pres, freq = ((torch.rand(5, generator=gen) * 2 - 1).numpy() for _ in range(2))
    expected = apply_penalties(logits.clone(), rows, token_ids, lengths[:, 0], lengths[:, 1], rep, pres, freq)
    assert not torch.equal(expected, logits)
    zeros = np.zeros(7, dtype=np.float32)  # every row greedy
    num_prompt, num_tokens, by_row = np.zeros(7, np.int64), np.zeros(7, np.int64), np.zeros((7, 600), np.int64)
    num_prompt[rows], num_tokens[rows], by_row[rows] = lengths[:, 0], lengths[:, 1], token_ids
    pen = dict(repetition=zeros + 1, presence=zeros.copy(), frequency=zeros.copy())
    pen["repetition"][rows], pen["presence"][rows], pen["frequency"][rows] = rep, pres, freq
    params = sampling_inputs.pack_params(
        zeros, np.zeros(7, dtype=np.int64), zeros + 1, zeros, num_prompt=num_prompt, num_tokens=num_tokens, **pen
    )
    x = logits.to(DEVICE)
    work = torch.empty(5, vocab, device=DEVICE)
    order = np.sort(rows)  # the penalized rows take their work rows in batch order
    inputs = sampling_kernels.device_inputs(params, order, by_row[order])
    tokens = sampling.sample(x, inputs, 0, block=16, work=work).cpu()
    torch.testing.assert_close(work.cpu(), expected[order])  # the penalized copies
    assert torch.equal(x.cpu(), logits)  # the logits stay as they are
    assert torch.equal(tokens, expected.argmax(dim=-1))  # every row's argmax, penalized where it is
