"""The parallel pre-compile of Triton kernels (pagedllm/worker/kernel_warmup.py) without a GPU: Triton's driver is
replaced by one that names an sm_90 target, so the recording pass binds real launches and the pool compiles them to
cubins with Triton's own compiler. The kernels are this file's (JITFunction built directly: the tests run with
TRITON_INTERPRET=1 on CPU), so the engine's kernels keep no entry compiled for the stand-in device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from pagedllm.worker.kernel_warmup import KernelPrecompile, record_specializations  # noqa: E402


def _scale(x_ptr, out_ptr, n, factor, BLOCK: tl.constexpr, SQUARE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    if SQUARE:
        x = x * x
    tl.store(out_ptr + offs, x * factor, mask=offs < n)


class _Sm90:
    """Triton's driver as far as binding and compiling need it (nothing launches)."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


@pytest.fixture
def sm90(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(knobs.cache, "dir", str(tmp_path))
    previous = driver._active
    driver.set_active(_Sm90())
    try:
        yield
    finally:
        driver._active = previous


def ran_isolated(request) -> bool:
    """True in the suite's process, after this test passed in a fresh interpreter (else it fails here): the driver,
    the compile cache and the async compile mode are Triton's process-wide state, which the suite's earlier tests
    (interpreted kernels) leave changed, and the pool's compiles then did not reach the kernel's cache. False in
    the fresh interpreter: the test runs."""
    if os.environ.get("PAGEDLLM_ISOLATED_TEST"):
        return False
    env = {**os.environ, "PAGEDLLM_ISOLATED_TEST": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid]
    proc = subprocess.run(cmd, cwd=request.config.rootpath, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return True


def _runner(world_size: int = 1, device: str = "cuda") -> SimpleNamespace:
    """What KernelPrecompile reads of a model runner."""
    return SimpleNamespace(
        device=torch.device(device), groups=SimpleNamespace(info=SimpleNamespace(world_size=world_size))
    )


def _launch(kernel, x: torch.Tensor, square: bool, factor: float = 2.0) -> None:
    out = torch.empty_like(x)
    kernel[(triton.cdiv(x.numel(), 64),)](x, out, x.numel(), factor, BLOCK=64, SQUARE=square)


def test_recorded_specializations_compile_into_the_kernel_cache(request, sm90):
    if ran_isolated(request):
        return
    kernel = JITFunction(_scale)
    x = torch.randn(256, dtype=torch.float32)

    def passes():
        _launch(kernel, x, False)
        _launch(kernel, x[:100], False, 3.0)  # n 100 (not 1, not a multiple of 16): another specialization
        _launch(kernel, x[:200], False, 0.5)  # n 200: the same one as 100 (a float is never specialized)
        _launch(kernel, x, True)  # another constexpr

    specs = record_specializations(passes)
    assert knobs.runtime.jit_cache_hook is None  # put back
    assert [fn for fn, _ in specs] == [kernel] * 3
    keys = [json.loads(data)["key"] for _, data in specs]
    assert len(set(keys)) == 3
    cache = kernel.device_caches[0][0]
    assert not cache  # recording compiled nothing and launched nothing
    with KernelPrecompile(_runner(), threads=3) as precompile:
        precompile.record(lambda runner: passes())  # records them again (nothing compiled yet) and compiles them
    assert sorted(cache) == sorted(keys)  # the keys a launch looks up: it finds them compiled
    for key in keys:
        assert cache[key].asm["cubin"]
        assert ".target sm_90" in cache[key].asm["ptx"]
    assert record_specializations(lambda: None) == []


def test_a_failing_pass_keeps_what_it_recorded(request, sm90):
    if ran_isolated(request):
        return
    kernel = JITFunction(_scale)
    x = torch.randn(64, dtype=torch.float32)

    def passes():
        _launch(kernel, x, False)
        raise RuntimeError("a step the pass cannot run")

    specs = record_specializations(passes)
    assert len(specs) == 1 and specs[0][0] is kernel
    assert knobs.runtime.jit_cache_hook is None


def test_precompile_compiles_while_the_caller_goes_on(request, sm90):
    if ran_isolated(request):
        return
    from triton.runtime._async_compile import active_mode

    kernel = JITFunction(_scale)
    x = torch.randn(256, dtype=torch.float32)
    runner = _runner()
    with KernelPrecompile(runner, threads=2) as precompile:
        precompile.record(lambda r: _launch(kernel, x, False))  # compiling from here on
        assert active_mode.get() is not None
        nested = KernelPrecompile(runner, threads=2)  # an engine started inside this one's start: off
        assert nested.mode is None
        nested.finish()
        precompile.record(lambda r: (_launch(kernel, x, False), _launch(kernel, x, True)))  # the first: submitted
        precompile.finish()
        assert active_mode.get() is None
        assert len(kernel.device_caches[0][0]) == len(precompile.submitted) == 2
    assert active_mode.get() is None
    assert KernelPrecompile(_runner(world_size=2), threads=2).mode is None
    assert KernelPrecompile(_runner(device="cpu"), threads=2).mode is None
    assert KernelPrecompile(runner, threads=0).mode is None
