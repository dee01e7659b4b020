"""The GPU sampler's kernel modules for the tests. Without CUDA they run in Triton's interpreter (see conftest.py):
modules imported before it was switched on are reloaded, the shared row passes first, then the kernels that import
them."""

from __future__ import annotations

import importlib

import torch

_ORDER = ("row_passes", "race", "penalties", "logprobs", "sampling")  # each after the modules it imports


def load():
    """The penalties, logprobs and sampling modules, interpreted where there is no CUDA."""
    modules = [importlib.import_module(f"pagedllm.kernels.{name}") for name in _ORDER]
    if not torch.cuda.is_available() and type(modules[0]._tokens).__name__ != "InterpretedFunction":
        modules = [importlib.reload(module) for module in modules]
    return modules[2:]


def race_module():
    """pagedllm/kernels/race.py, interpreted where there is no CUDA (after load())."""
    load()
    return importlib.import_module("pagedllm.kernels.race")


def device_inputs(params, penalized=None, tokens=None, wanted=None, device=None, advance=False):
    """The sampling kernel's inputs for a batch whose rows are its logits' rows (sampling_inputs.pack_inputs), on
    the device: params [batch, PARAMS], penalized [num_pen] rows with their tokens [num_pen, max_len] (lengths in
    params), wanted [wanted] rows."""
    from pagedllm.kernels.sampling_inputs import DeviceInputs, pack_inputs

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    state, step, token_cap = pack_inputs(params, penalized, tokens, wanted)
    num_pen = 0 if penalized is None else len(penalized)
    as_tensor = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    return DeviceInputs(as_tensor(state), as_tensor(step), len(params), token_cap, num_pen, advance)
