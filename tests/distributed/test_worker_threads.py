"""How many torch CPU threads each rank's process runs with."""

from __future__ import annotations

import torch

from pagedllm.worker.cpu_threads import worker_threads


def test_gpu_ranks_run_one_thread_unless_omp_num_threads_is_set(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert worker_threads(on_cuda=True, world=4) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    assert worker_threads(on_cuda=True, world=4) == 0  # torch's default, which honours the variable


def test_cpu_ranks_share_the_threads(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    assert worker_threads(on_cuda=False, world=2) == 4
    assert worker_threads(on_cuda=False, world=16) == 1
