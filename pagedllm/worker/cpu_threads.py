"""torch's CPU threads. VLLM_CPU_OMP_THREADS_BIND on CPU: the engine's process runs on the listed cores, one torch
thread each (threads started later, OpenMP's among them, inherit the affinity). worker_threads: how many each rank's
process runs with several ranks."""

from __future__ import annotations

import logging
import os

import torch

from pagedllm import envs

logger = logging.getLogger(__name__)


def bind_cpu_threads() -> list[int] | None:
    """Applies VLLM_CPU_OMP_THREADS_BIND (nothing when unset or `auto`); the cores bound, or None. A core this
    process may not run on is a ValueError naming the variable."""
    cpus = envs.cpu_omp_threads_bind()
    if cpus is None or not hasattr(os, "sched_setaffinity"):
        return None
    allowed = os.sched_getaffinity(0)
    outside = sorted(set(cpus) - allowed)
    if outside:
        name = envs.get("VLLM_CPU_OMP_THREADS_BIND")[0]
        raise ValueError(
            f"{name}: cores {outside} are not available to this process: allowed {sorted(allowed)} (or `auto`)"
        )
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))
    logger.info("CPU threads bound to cores %s", cpus)
    return cpus


def worker_threads(on_cuda: bool, world: int) -> int:
    """torch's CPU threads in each rank's process (0: torch's default). On CPUs the machine's threads shared among the
    ranks. On GPUs one, as vLLM does, unless OMP_NUM_THREADS is set: a step's host work is Python and small ops, and
    every rank's process with a thread per core (OpenMP threads that spin after a parallel op) contends with the
    host paths of the other ranks, which every all-reduce waits for."""
    if not on_cuda:
        return max(1, torch.get_num_threads() // world)
    return 0 if "OMP_NUM_THREADS" in os.environ else 1
