"""Host-device copies: HostCopies copies views of one buffer in one copy, into pinned memory it reuses; Staging off
CUDA copies the words."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pagedllm.device as device


@pytest.mark.gpu
def test_views_of_one_buffer_travel_in_one_copy_into_reused_pinned_memory():
    words = torch.arange(40, dtype=torch.int32, device="cuda")
    tokens, logprobs = words[:6].view(torch.int64), words[8:20].view(3, 4)  # as the sampling kernel's buffer
    copies = device.HostCopies()
    (got_tokens, got_logprobs), pinned = copies.copy(tokens, logprobs)
    torch.cuda.current_stream().synchronize()
    assert got_tokens.dtype == np.int64 and got_tokens.tolist() == tokens.tolist()
    assert got_logprobs.shape == (3, 4) and got_logprobs.tolist() == logprobs.tolist()
    assert len(pinned.views) == 1  # one copy, of the whole buffer
    copies.give_back(pinned)
    words += 100
    (again,), reused = copies.copy(logprobs)  # a copy made after give_back writes the same pinned memory
    torch.cuda.current_stream().synchronize()
    assert reused is pinned and again.tolist() == logprobs.tolist()
    other = torch.arange(5, device="cuda")
    (got_other, got_logprobs), separate = copies.copy(other, logprobs)  # not one buffer: a copy each
    torch.cuda.current_stream().synchronize()
    assert separate is not pinned and len(separate.views) == 2
    assert got_other.tolist() == list(range(5)) and got_logprobs.tolist() == logprobs.tolist()


def test_host_copies_off_cuda_are_the_tensors():
    tokens = torch.arange(6)
    (got,), pinned = device.HostCopies().copy(tokens)
    assert pinned is None and got.tolist() == list(range(6))


def test_staging_off_cuda_copies_the_words():
    staging = device.Staging(torch.device("cpu"))
    words = np.arange(7, dtype=np.int32)
    out = staging.upload(words)
    words[:] = 0  # the upload does not alias the host words
    assert out.tolist() == list(range(7))
