"""vLLM's `vllm.utils.torch_utils.set_random_seed`: the process's global random number generators."""

from __future__ import annotations

import random

import numpy as np
import torch


def set_random_seed(seed: int) -> None:
    """Seeds Python's `random`, numpy's global generator and torch's (CPU and every CUDA device), as vLLM's engine
    does in the caller's process. (The engine's sampler and dummy weights use their own generators.)"""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
