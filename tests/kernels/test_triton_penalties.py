"""The Triton penalties against the torch path (held to HF's repetition penalty and the OpenAI formula in
tests/sample/test_logits_processors.py). Without CUDA the kernels run in Triton's interpreter (see conftest.py)."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from pagedllm.sample.logits_processors import apply_penalties

pytest.importorskip("triton")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
penalties = importlib.import_module("pagedllm.kernels.penalties")
if DEVICE.type == "cpu" and type(penalties.penalize_kernel).__name__ != "InterpretedFunction":
    penalties = importlib.reload(penalties)  # imported before the interpreter was switched on


@pytest.mark.parametrize("vocab", [50, 1000])
def test_kernels_equal_the_torch_path(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(7, vocab, generator=gen) * 4
    lengths = np.array([(5, 12), (0, 0), (3, 3), (8, 300), (1, 2)])  # (prompt, all tokens) per penalized row
    token_ids = torch.randint(0, 6, (5, 300), generator=gen).numpy()  # few distinct tokens: many repeats
    token_ids[3, :200] = torch.randint(0, vocab, (200,), generator=gen).numpy()  # over two blocks of places
    rows = np.array([4, 0, 2, 6, 1])
    rep = np.array([1.3, 0.7, 2.0, 1.1, 1.0], dtype=np.float32)
    pres, freq = ((torch.rand(5, generator=gen) * 2 - 1).numpy() for _ in range(2))
    expected = apply_penalties(logits.clone(), rows, token_ids, lengths[:, 0], lengths[:, 1], rep, pres, freq)
    assert not torch.equal(expected, logits)
    packed = torch.from_numpy(penalties.pack_rows(rows, token_ids, lengths[:, 0], lengths[:, 1], rep, pres, freq))
    torch.testing.assert_close(penalties.apply_penalties(logits.clone().to(DEVICE), packed.to(DEVICE)).cpu(), expected)
