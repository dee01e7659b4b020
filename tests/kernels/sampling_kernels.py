"""The GPU sampler's kernel modules for the tests. Without CUDA they run in Triton's interpreter (see conftest.py):
modules imported before it was switched on are reloaded, the shared row passes first, then the kernels that import
them."""

from __future__ import annotations

import importlib

import torch

_ORDER = ("row_passes", "penalties", "logprobs", "sampling")  # each after the modules it imports


def load():
    """The penalties, logprobs and sampling modules, interpreted where there is no CUDA."""
    modules = [importlib.import_module(f"pagedllm.kernels.{name}") for name in _ORDER]
    if not torch.cuda.is_available() and type(modules[0]._tokens).__name__ != "InterpretedFunction":
        modules = [importlib.reload(module) for module in modules]
    return modules[1:]
