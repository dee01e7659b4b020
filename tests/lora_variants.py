"""Shared by the LoRA kernel tests: which compiled variants (Triton specializations) the LoRA kernels launch."""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path

import torch


def specialization(kernel, args, kwargs) -> tuple:
    """What Triton compiles a variant of `kernel` for: each runtime argument's type and specialization (an int of 1,
    a multiple of 16, a 16-byte aligned pointer: Triton's own rule, unless the kernel opts the argument out), then
    the constexprs."""
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import native_specialize_impl

    opts = getattr(kernel, "kwargs", None) or vars(kernel)  # interpreted, or compiled
    plain = set(opts.get("do_not_specialize") or ())
    unaligned = set(opts.get("do_not_specialize_on_alignment") or ())
    names = list(inspect.signature(kernel.fn).parameters)
    spec = [
        native_specialize_impl(CUDABackend, v, False, n not in plain, n not in unaligned) for n, v in zip(names, args)
    ]
    return (*spec, *sorted(kwargs.items()))


def record_variants(monkeypatch, ops) -> dict[tuple[str, int], set]:
    """{(kernel name, the layer: its weights' address): the specializations launched}, filled by every launch of the
    LoRA kernels of module `ops` (pagedllm.kernels.lora) from now on."""
    seen: dict[tuple[str, int], set] = {}
    for attr, kernel in (("_shrink", ops.lora_shrink_kernel), ("_expand", ops.lora_expand_kernel),
                         ("_fused", ops.lora_fused_kernel)):  # fmt: skip
        launch = getattr(ops, attr)

        def record(grid, *args, _launch=launch, _kernel=kernel, **kwargs):
            layer = args[1].data_ptr()  # A (shrink, fused) or B (expand): the layer's own slots
            seen.setdefault((_kernel.fn.__name__, layer), set()).add(specialization(_kernel, args, kwargs))
            _launch(grid, *args, **kwargs)

        monkeypatch.setattr(ops, attr, record)
    return seen


def interpreter_fixes() -> None:
    """Without CUDA: the kernel tests' fixes of Triton's interpreter (tests/kernels/conftest.py: scalars as Python
    ints with NumPy >= 2.3, bfloat16 dots and casts), for a test outside tests/kernels that runs kernels in it."""
    import triton.runtime.interpreter as interpreter

    if torch.cuda.is_available() or interpreter._patch_lang_tensor.__name__ == "_patch_lang_tensor_item":
        return  # compiled kernels, or the fixes are in already
    spec = importlib.util.spec_from_file_location(
        "kernel_tests_conftest", Path(__file__).parent / "kernels/conftest.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
