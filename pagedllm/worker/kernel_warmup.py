"""GPU start-up: the Triton kernels of the engine's first steps compiled in parallel, before the memory profile.

Each kernel would otherwise compile when first launched, one after another (seconds each on a fresh machine: the
sampling kernel alone takes several). Here one pass runs the steps the start-up and the first requests launch (the
profile's prefill at max_num_batched_tokens and its sampling in float32 with penalties and logprobs, sampling of the
model's-dtype logits, the decode forward at every CUDA-graph size, or an eager decode) with Triton's jit_cache_hook
recording each new specialization and skipping it (neither compiled nor launched: that pass computes nothing that
is read, its outputs are left as they are). Then a thread pool compiles the recorded specializations at once
(Triton's AsyncCompileMode: its compiler releases the GIL, ptxas is a process of its own), each exactly as a launch
would have, into the kernel's cache (and Triton's disk cache, so a second start reads them back in parallel too).
Anything the pass missed compiles on first launch as before."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

logger = logging.getLogger(__name__)


def compile_kernels(runner, threads: int) -> int:
    """On CUDA with one rank (every rank would have to fail alike in the pass), threads > 0: compiles the
    specializations the first steps launch; returns how many (0: none or skipped)."""
    if not runner.on_cuda or threads <= 0 or runner.groups.info.world_size > 1:
        return 0
    import triton

    if not hasattr(triton, "AsyncCompileMode"):  # Triton < 3.4: kernels compile when first launched
        return 0
    start = time.perf_counter()
    specs = record_specializations(lambda: first_steps(runner))
    compile_in_parallel(specs, threads)
    logger.info(
        "compiled %d Triton kernel specializations on %d threads in %.2f s",
        len(specs),
        threads,
        time.perf_counter() - start,
    )
    return len(specs)


def record_specializations(passes: Callable[[], None]) -> list[tuple[object, str]]:
    """Runs passes with every Triton launch of a kernel specialization not compiled yet skipped and recorded;
    returns (the JITFunction, its specialization data for JITFunction.preload) per distinct specialization. A pass
    that fails ends the recording there (logged): what it recorded still counts."""
    from triton import knobs

    recorded: dict[tuple[int, str], tuple[object, str]] = {}

    def hook(*, key, fn, compile, **_) -> bool:
        recorded.setdefault((id(fn.jit_function), key), (fn.jit_function, compile["specialization_data"]))
        return True  # skip: neither compiled nor launched now

    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    try:
        passes()
    except Exception as e:  # the kernels not recorded compile on first launch
        logger.info("kernel pre-compile: the recording pass stopped early (%s: %s)", type(e).__name__, e)
    finally:
        knobs.runtime.jit_cache_hook = previous
    return list(recorded.values())


def compile_in_parallel(specs: list[tuple[object, str]], threads: int) -> None:
    """Compiles (or reads from Triton's disk cache) each specialization on a pool of threads; returns when all are
    in their kernel's cache. One that fails to compile is left out (its launch compiles it and reports the error)."""
    import triton

    if not specs:
        return
    with ThreadPoolExecutor(max_workers=min(threads, len(specs))) as pool:
        with triton.AsyncCompileMode(pool, ignore_errors=True):
            for fn, data in specs:
                fn.preload(data)


@torch.inference_mode()
def first_steps(runner) -> None:
    """The launches of the start-up and of the first steps: the memory profile's prefill and sampling, sampling
    of the model's-dtype logits (rows without penalties or logprobs), and the decode forwards."""
    from pagedllm.worker.gpu_memory import _dummy_prefill, _dummy_sample, _temporary_kv_cache, profile_batch

    sched = runner.config.scheduler
    lens, num_blocks = profile_batch(runner)
    with _temporary_kv_cache(runner, num_blocks):
        hidden = _dummy_prefill(runner, lens, num_blocks)  # [num_tokens, hidden]
        _dummy_sample(runner, hidden, sched.max_num_seqs)
        _plain_sample(runner, hidden[: min(len(hidden), sched.max_num_seqs)])
        if runner.graphs is not None:
            for bs in runner.graphs.sizes:
                runner.graphs.clear_inputs()
                runner.graphs.forward_eager(bs)
        else:
            _dummy_prefill(runner, np.ones(sched.max_num_seqs, dtype=np.int64), num_blocks)  # decodes: 1 token each


def _plain_sample(runner, hidden: torch.Tensor) -> None:
    """Temperature 1 without filters, penalties or logprobs: the logits stay in the model's dtype."""
    from pagedllm.sample.metadata import SamplingMetadata

    n = hidden.shape[0]
    logits = runner.model.compute_logits(hidden, False)  # [n, vocab]
    zeros = np.zeros(n, dtype=np.float32)
    meta = SamplingMetadata.build(
        np.ones(n, dtype=np.float32),
        np.zeros(n, dtype=np.int64),
        np.ones(n, dtype=np.float32),
        zeros,
        device=runner.device,
        impl=runner.sampler.impl,
    )
    runner.sampler.rules(logits, meta)
