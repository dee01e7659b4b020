"""Which launches take part in programmatic dependent launch (kernels.pdl): CUDA tensors on Hopper or later with a
compiling Triton that has the grid-dependency instructions; never CPU tensors or Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from pagedllm import kernels


def test_cpu_tensors_launch_without_it():
    assert kernels.pdl(torch.zeros(1)) == {"USE_PDL": False}


def test_interpreter_turns_it_off(monkeypatch):
    pytest.importorskip("triton")
    kernels._pdl_device.cache_clear()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    try:
        assert kernels._pdl_device(0) is False
    finally:
        kernels._pdl_device.cache_clear()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_hopper_launches_with_it():
    x = torch.zeros(1, device="cuda")
    on = torch.cuda.get_device_capability()[0] >= 9
    assert kernels.pdl(x) == ({"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False})
