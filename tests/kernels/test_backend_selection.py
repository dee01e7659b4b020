"""Which attention backend the engine picks: triton on CUDA (when installed), torch elsewhere, or the user's choice."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention import get_backend, torch_backend
from pagedllm.config import DeviceConfig
from pagedllm.kernels import triton_available


def test_cpu_uses_torch():
    assert get_backend("auto", torch.device("cpu")) is torch_backend
    assert get_backend("torch", torch.device("cpu")) is torch_backend


def test_triton_on_cpu_is_refused():
    with pytest.raises(ValueError, match="attention_backend='triton' runs on CUDA devices only"):
        get_backend("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match="attention_backend='triton' runs on CUDA devices only"):
        DeviceConfig(torch.device("cpu"), attention_backend="triton")


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="attention_backend='flash' must be one of"):
        DeviceConfig(torch.device("cpu"), attention_backend="flash")


@pytest.mark.gpu
def test_cuda_uses_triton_unless_asked_for_torch():
    assert triton_available()
    from pagedllm.attention import triton_backend

    assert get_backend("auto", torch.device("cuda")) is triton_backend
    assert get_backend("triton", torch.device("cuda")) is triton_backend
    assert get_backend("torch", torch.device("cuda")) is torch_backend
