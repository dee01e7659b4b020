"""The Triton penalties (inside the sampling kernel, in place or on copies of the penalized rows) against the torch
path (held to HF's repetition penalty and the OpenAI formula in tests/sample/test_logits_processors.py). Without CUDA
the kernels run in Triton's interpreter (see conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest
import sampling_kernels
import torch
import triton
import triton.language as tl

from pagedllm.kernels import sampling_inputs
from pagedllm.sample.logits_processors import apply_penalties

pytest.importorskip("triton")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
penalties, _, sampling = sampling_kernels.load()


def _case(vocab):
    """7 rows of logits, 5 of them penalized (few distinct tokens: many repeats; one row over two blocks of places),
    their expected penalized logits (the torch path), and the kernel's params (every row greedy)."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(7, vocab, generator=gen) * 4
    lengths = np.array([(5, 12), (0, 0), (3, 3), (8, 600), (1, 2)])  # (prompt, all tokens) per penalized row
    token_ids = torch.randint(0, 6, (5, 600), generator=gen).numpy()
    token_ids[3, :400] = torch.randint(0, vocab, (400,), generator=gen).numpy()
    rows = np.array([4, 0, 2, 6, 1])
    rep = np.array([1.3, 0.7, 2.0, 1.1, 1.0], dtype=np.float32)
    pres, freq = ((torch.rand(5, generator=gen) * 2 - 1).numpy() for _ in range(2))
    expected = apply_penalties(logits.clone(), rows, token_ids, lengths[:, 0], lengths[:, 1], rep, pres, freq)
    assert not torch.equal(expected.argmax(dim=-1), logits.argmax(dim=-1))  # the argmax sees the penalties
    zeros = np.zeros(7, dtype=np.float32)
    num_prompt, num_tokens, by_row = np.zeros(7, np.int64), np.zeros(7, np.int64), np.zeros((7, 600), np.int64)
    num_prompt[rows], num_tokens[rows], by_row[rows] = lengths[:, 0], lengths[:, 1], token_ids
    pen = dict(repetition=zeros + 1, presence=zeros.copy(), frequency=zeros.copy())
    pen["repetition"][rows], pen["presence"][rows], pen["frequency"][rows] = rep, pres, freq
    params = sampling_inputs.pack_params(
        zeros, np.zeros(7, dtype=np.int64), zeros + 1, zeros, num_prompt=num_prompt, num_tokens=num_tokens, **pen
    )
    return logits, expected, params, np.sort(rows), by_row  # the penalized rows take work rows in batch order


@pytest.mark.parametrize("vocab", [50, 1000])
def test_sampling_kernel_penalizes_copies_or_rows_in_place_as_the_torch_path(vocab):
    """A penalized row that wants logprobs is penalized in a copy (its logprobs read the logits as they are); the
    others in place, their logits put back once sampled."""
    logits, expected, params, order, by_row = _case(vocab)
    x = logits.to(DEVICE)
    work = torch.full((5, vocab), float("nan"), device=DEVICE)
    copied = order[[1, 3]]  # these want logprobs
    inputs = sampling_kernels.device_inputs(params, order, by_row[order], wanted=copied)
    lp = sampling.Logprobs(x, torch.zeros(2, 4, dtype=torch.int32, device=DEVICE), 0, False)
    tokens = sampling.sample(x, inputs, 0, lp, block=16, work=work).cpu()
    torch.testing.assert_close(work[[1, 3]].cpu(), expected[copied])  # the penalized copies
    assert torch.equal(x.cpu(), logits)  # the logits as they were
    assert torch.equal(tokens, expected.argmax(dim=-1))  # every row's argmax, penalized where it is
    lse = torch.log_softmax(logits[copied], dim=-1)  # the logprobs read the logits before the penalties
    chosen = lp.out[:, 2].view(torch.float32) - lp.out[:, 3].view(torch.float32)
    torch.testing.assert_close(chosen.cpu(), lse.gather(1, tokens[copied][:, None]).squeeze(1), atol=2e-3, rtol=0)


@triton.jit
def _in_place_then_restored(row_ptr, seen_ptr, saved_ptr, table_ptr, tokens_ptr, num_prompt, num_tokens, rep,
                            presence, frequency, vocab, BLOCK: tl.constexpr):  # fmt: skip
    """penalize_in_place, the row as the sampling sees it copied to seen, then restore_row."""
    penalties.penalize_in_place(row_ptr, saved_ptr, table_ptr, tokens_ptr, num_prompt, num_tokens, rep, presence,
                                frequency, BLOCK)  # fmt: skip
    for start in range(0, vocab, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        tl.store(seen_ptr + idx, tl.load(row_ptr + idx, mask=idx < vocab), mask=idx < vocab)
    penalties.restore_row(row_ptr, saved_ptr, tokens_ptr, num_tokens, BLOCK)


@pytest.mark.parametrize("vocab", [50, 1000])
def test_in_place_penalties_are_the_torch_paths_and_put_back_exactly(vocab):
    logits, expected, params, order, by_row = _case(vocab)
    floats = params.view(np.float32)
    for row in order:
        x = logits[row].to(DEVICE)
        seen, saved = torch.empty_like(x), torch.empty_like(x)
        table = torch.full((vocab,), 12345, dtype=torch.int32, device=DEVICE)  # not zeroed: the kernel does
        tokens = torch.from_numpy(by_row[row].astype(np.int32)).to(DEVICE)
        _in_place_then_restored[(1,)](
            x, seen, saved, table, tokens, int(params[row, 8]), int(params[row, 9]), *floats[row, 10:13].tolist(),
            vocab, BLOCK=512,
        )  # fmt: skip
        torch.testing.assert_close(seen.cpu(), expected[row])
        assert torch.equal(x.cpu(), logits[row])  # bit for bit
