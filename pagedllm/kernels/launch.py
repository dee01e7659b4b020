"""Launches of a Triton kernel with less host time per call, for kernels launched every engine step.
`kernel[grid](*args)` spends about 23 us of host time on the sampling kernel's 25 arguments (H100 host): Triton reads
its settings, checks the globals the kernel uses, binds and specializes the arguments, builds launch metadata for the
profiler hooks, then calls the compiled kernel's launcher. A `Launch` binds and specializes the arguments with Triton's
own binder (so the compiled kernel it finds is exactly the one Triton would run) and calls that kernel's launcher
directly; and it keeps, per set of specializations launched (each argument's dtype and alignment, or an int's being 1, a
multiple of 16 and its width: a superset of what Triton compiles for), the compiled kernel and the constexpr values, so
that a later launch with the same ones calls the launcher without binding. What it skips: Triton's settings read per
call (TRITON_DEBUG and the instrumentation mode are read once, when the Launch is made), the check that the kernel's
globals have not changed (ours are constants) and the launch hooks (while a profiler's hook is installed, every launch
goes through Triton).

A specialization not yet compiled, or a Triton other than 3.6 (whose internals this was written against and tested
on), launches through Triton as usual. `Memory` keeps a kernel's working memory from launch to launch."""

from __future__ import annotations

import math

import torch
import triton

_KNOWN = tuple(int(x) for x in triton.__version__.split(".")[:2]) == (3, 6)  # the internals this was checked on
if _KNOWN:
    from triton import knobs
    from triton.runtime.driver import driver
    from triton.runtime.jit import compute_cache_key


class Launch:
    """fn[grid](*args, **kwargs) for one Triton kernel, through its compiled form where Triton has one."""

    def __init__(self, kernel: triton.JITFunction) -> None:
        self.kernel = kernel
        self.direct = _KNOWN and isinstance(kernel, triton.JITFunction)  # not under the interpreter
        if self.direct:
            self.options = {"debug": kernel.debug or knobs.runtime.debug}
            self.options["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        # the compiled kernel and the constexpr values of each specialization launched (_specialization of the
        # positional arguments, then the keyword values: the constexprs and the options)
        self.known: dict[tuple, tuple] = {}

    def __call__(self, grid: int, *args, **kwargs) -> None:
        """kwargs: the kernel's constexpr arguments (in the kernel's order) and its launch options (num_warps)."""
        if self.direct and not (knobs.runtime.launch_enter_hook.calls or knobs.runtime.launch_exit_hook.calls):
            device = driver.active.get_current_device()
            key = (device, *map(_specialization, args), *kwargs.values())
            known = self.known.get(key)
            if known is not None:  # launched with these specializations before: no binding
                compiled, constexprs = known
                stream = driver.active.get_current_stream(device)
                compiled.run(grid, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
                             *args, *constexprs)  # fmt: skip
                return
            caches = self.kernel.device_caches.get(device)
            if caches is not None:
                kernel_cache, key_cache, _, _, binder = caches
                bound, specialization, options = binder(*args, **kwargs, **self.options)
                compiled = kernel_cache.get(compute_cache_key(key_cache, specialization, options))
                if getattr(compiled, "function", None) is not None:  # compiled and loaded
                    stream = driver.active.get_current_stream(device)
                    values = list(bound.values())
                    if len(self.known) < 256:
                        self.known[key] = (compiled, tuple(values[len(args) :]))
                    compiled.run(grid, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
                                 *values)  # fmt: skip
                    return
        self.kernel[(grid,)](*args, **kwargs)


def _specialization(arg):
    """What of a positional argument Triton may compile a kernel for (a superset): a tensor's dtype and 16-byte
    alignment; an int's being 1, a multiple of 16, and its width."""
    if isinstance(arg, int):  # a bool is its own type to Triton (u1)
        return type(arg), arg == 1, arg & 15 == 0, -(2**31) <= arg < 2**31, arg < 2**63
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() & 15 == 0
    return type(arg), arg


class Memory:
    """The kernel's working memory (its lists and counts; the penalized copies of rows), kept from launch to launch:
    on a GPU host an allocation or a view costs microseconds, and a step that needs the shapes of the last one
    gets the same tensors again. Launches that share it must run one after another (on one stream)."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}  # by use: the memory, at least as large as any view of it
        self.views: dict[str, tuple[tuple, torch.Tensor]] = {}  # by use: the last view handed out, and its key

    def take(self, use: str, shape: tuple[int, ...], device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        key = (shape, device, dtype)
        last = self.views.get(use)
        if last is not None and last[0] == key:
            return last[1]
        size = math.prod(shape) * dtype.itemsize
        buffer = self.buffers.get(use)
        if buffer is None or buffer.device != device or buffer.numel() < size:
            buffer = self.buffers[use] = torch.empty(size * 5 // 4, dtype=torch.uint8, device=device)
        view = buffer[:size].view(dtype).view(shape)
        self.views[use] = (key, view)
        return view
