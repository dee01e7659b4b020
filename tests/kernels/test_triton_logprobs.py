"""The Triton logprobs against a float64 log-softmax: the chosen token's logprob and rank, the top-n tokens in order
with theirs; with banned tokens, a maximum in the last tile, and many equal logits (the exact search). Both the
logprobs kernel (tokens known beforehand) and the sampling kernel's (its sampled tokens, from the logits as they
were before the penalties, or from copies). Without CUDA the kernels run in Triton's interpreter (see conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest
import sampling_kernels
import torch

from pagedllm.kernels import sampling_inputs

pytest.importorskip("triton")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
penalties, logprobs, sampling = sampling_kernels.load()


def raw_rows(vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randn(6, vocab, generator=g) * 4
    raw[1, : vocab // 2] = float("-inf")  # banned tokens
    raw[2, -1] = 30.0  # the maximum in the last tile
    raw[3, 7 : 7 + min(200, vocab - 7)] = raw[3].max() + 1.0  # up to 200 equal largest logits: more than the list
    return raw


def check(out: torch.Tensor, raw: torch.Tensor, chosen: torch.Tensor, num_top: int, ties: int = 3) -> None:
    """out [rows, 4 + 2 num_top] (pack_logprobs' layout) against raw's float64 log-softmax (row ties: raw_rows' row
    of many equal values)."""
    assert out.shape == (len(raw), 4 + 2 * num_top)
    assert torch.equal(out[:, 0], chosen.int())
    floats = out.view(torch.float32)
    ranks, lp = out[:, 1], floats[:, 2] - floats[:, 3]
    top_ids, top_lp = out[:, 4 : 4 + num_top], floats[:, 4 + num_top :]
    ref = raw.double().log_softmax(dim=-1)
    for i in range(len(raw)):
        c = int(chosen[i])
        assert int(ranks[i]) == 1 + int((raw[i] > raw[i, c]).sum())
        assert float(lp[i]) == pytest.approx(float(ref[i, c]), abs=1e-4)
        ids = top_ids[i].tolist()
        assert len(set(ids)) == num_top
        assert torch.equal(raw[i, ids], raw[i].topk(num_top).values)  # the largest, in order
        if i == ties:  # among equal values the lowest tokens come first
            assert ids == list(range(7, 7 + num_top))
        torch.testing.assert_close(top_lp[i].double(), ref[i, ids], atol=1e-4, rtol=0)


@pytest.mark.parametrize("vocab", [50, 3000] + ([151_936] if DEVICE.type == "cuda" else []))
@pytest.mark.parametrize("num_top", [0, 1, 5, 20])
def test_logprobs_match_a_float64_log_softmax(vocab, num_top):
    raw = raw_rows(vocab, vocab + num_top)
    chosen = torch.randint(0, vocab, (6,), generator=torch.Generator().manual_seed(num_top))
    chosen[0] = raw[0].argmax()
    chosen[1] = vocab - 1
    check(logprobs.logprobs(raw.to(DEVICE), chosen.to(DEVICE), num_top).cpu(), raw, chosen, num_top)


@pytest.mark.parametrize("copied", [False, True])
@pytest.mark.parametrize("num_top", [0, 5])
def test_sampling_kernel_logprobs_of_its_tokens(copied, num_top):
    """Rows 0, 2, 3, 5, 6 and 7 of 8 want logprobs; rows 0 and 2 are penalized (the logprobs read them as they were);
    row 5 samples at temperature 1 with top-k 3, row 6 at 2 with top-k 20, row 7 at 0.7 with top-p 0.9; the others
    are greedy."""
    vocab = 300
    raw = torch.cat([raw_rows(vocab, num_top), raw_rows(vocab, 7)[:2]])  # [8, vocab]
    wanted = np.array([0, 2, 3, 5, 6, 7], dtype=np.int32)
    token_ids = np.stack([raw[0].argsort()[-3:].numpy(), raw[2].argsort()[-3:].numpy()])  # their largest, as outputs
    temperature = np.float32([0, 0, 0, 0, 0, 1.0, 2.0, 0.7])
    top_k = np.int64([0, 0, 0, 0, 0, 3, 20, 0])
    top_p = np.float32([1, 1, 1, 1, 1, 1, 1, 0.9])
    zeros = np.zeros(8, np.float32)
    num_tokens = np.int64([3, 0, 3, 0, 0, 0, 0, 0])  # rows 0 and 2: three tokens each (row 2: one of them prompt)
    presence = np.float32([50, 0, 50, 0, 0, 0, 0, 0])
    num_prompt = np.int64([0, 0, 1, 0, 0, 0, 0, 0])
    params = sampling_inputs.pack_params(
        temperature, top_k, top_p, zeros, num_prompt=num_prompt, num_tokens=num_tokens, repetition=zeros + 1,
        presence=presence, frequency=zeros + (num_tokens > 0),
    )  # fmt: skip
    out = torch.empty(6, 4 + 2 * num_top, dtype=torch.int32, device=DEVICE)
    x = raw.to(DEVICE)
    source = x[torch.from_numpy(wanted).long().to(DEVICE)] if copied else x
    inputs = sampling_kernels.device_inputs(params, np.array([0, 2]), token_ids, wanted)
    lp = sampling.Logprobs(source, out, num_top, copied)
    tokens = sampling.sample(x, inputs, 0, lp, block=16).cpu()
    check(out.cpu(), raw[wanted], tokens[wanted], num_top, ties=2)
    assert tokens[0] != raw[0].argmax() and tokens[2] != raw[2].argmax()  # penalized, but not in the logprobs
    assert int(tokens[5]) in raw[5].topk(3).indices.tolist()
    assert int(tokens[6]) in raw[6].topk(20).indices.tolist()
    kept = inputs.state.clone(), inputs.step.clone()  # without logprobs given, no program writes them (nor the state)
    again = sampling.sample(x, inputs, 0, block=16).cpu()
    assert torch.equal(inputs.state, kept[0]) and torch.equal(inputs.step, kept[1]) and torch.equal(again, tokens)


def test_logprobs_of_some_rows_read_in_place():
    """logprob_rows leaves the logits in place on the Triton path when no wanted row changes; logprob_tensors without
    the sampling kernel's output (as prompt logprobs call it) then reads just the wanted rows (on the CPU: the Triton
    path forced, the kernel in the interpreter)."""
    from pagedllm.sample.logprobs import logprob_rows, logprob_tensors

    raw = raw_rows(3000, 11).to(DEVICE)
    num_top = np.array([2, -1, 3, -1, 0, 5])
    rows = logprob_rows(raw, num_top, np.zeros(6, dtype=bool), impl="triton")
    assert rows.copied is None  # read in place
    sampled = torch.randint(0, 3000, (6,), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    out = logprob_tensors(rows, sampled, num_top, impl="triton").tolists()
    raw, ref = raw.cpu(), raw.cpu().double().log_softmax(dim=-1)
    for i, k in enumerate(num_top.tolist()):
        if k < 0:
            assert out[i] is None
            continue
        ids, lps, ranks = out[i]
        c = int(sampled[i])
        assert ids[0] == c and ranks[0] == 1 + int((raw[i] > raw[i, c]).sum())
        assert lps == pytest.approx(ref[i, ids].tolist(), abs=1e-4)
        assert ids[1:] == raw[i].topk(k).indices.tolist()
