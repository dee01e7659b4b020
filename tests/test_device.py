"""Host-device copies: pinned_copies copies views of one buffer in one copy; Staging off CUDA copies the words."""

from __future__ import annotations

import numpy as np
import torch

import pagedllm.device as device


def test_views_of_one_buffer_travel_in_one_copy(monkeypatch):
    copies = []
    monkeypatch.setattr(device, "pinned_copy", lambda t: copies.append(t.numel()) or t.clone())  # no CUDA here
    words = torch.arange(40, dtype=torch.int32)
    tokens, logprobs = words[:6].view(torch.int64), words[8:20].view(3, 4)  # as the sampling kernel's buffer
    got = device.pinned_copies(tokens, logprobs)
    assert copies == [20 * 4]  # bytes 0..80: one span over both
    assert torch.equal(got[0], tokens) and got[0].dtype == torch.int64
    assert torch.equal(got[1], logprobs) and got[1].shape == (3, 4)
    other = torch.arange(5)
    copies.clear()
    got = device.pinned_copies(other, logprobs)  # separate buffers: a copy each
    assert len(copies) == 2 and torch.equal(got[0], other) and torch.equal(got[1], logprobs)


def test_staging_off_cuda_copies_the_words():
    staging = device.Staging(torch.device("cpu"))
    words = np.arange(7, dtype=np.int32)
    out = staging.upload(words)
    words[:] = 0  # the upload does not alias the host words
    assert out.tolist() == list(range(7))
