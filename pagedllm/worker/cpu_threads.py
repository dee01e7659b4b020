"""VLLM_CPU_OMP_THREADS_BIND on CPU: the engine's process runs on the listed cores, one torch thread each (threads
started later, OpenMP's among them, inherit the affinity)."""

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
