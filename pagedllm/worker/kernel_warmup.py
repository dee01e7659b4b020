"""GPU start-up: the Triton kernels of the engine's first steps compiled in parallel, while the weights load.

Each kernel would otherwise compile when first launched, one after another (seconds each on a fresh machine: the
sampling kernel alone takes several). Here passes run the launches of the start-up and of the first requests with
Triton's jit_cache_hook recording each new specialization and skipping it (neither compiled nor launched: a pass
computes nothing that is read). A thread pool compiles each recorded specialization as soon as it is found (Triton's
AsyncCompileMode: its compiler releases the GIL, ptxas is a process of its own), exactly as a launch would have, into
the kernel's cache and Triton's disk cache (a second start reads them back in parallel too). The passes:
sampler_steps, before the model is built (the sampling kernel in float32 with penalties and logprobs, and in the
model's dtype: the longest compiles, under way while the weights load), then first_steps once it is built (the
profile's prefill at max_num_batched_tokens and its sampling, the decode forward at every CUDA-graph size or an
eager decode). The runner waits for the pool before the memory profile. Anything the passes missed compiles on
first launch as before."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

logger = logging.getLogger(__name__)


class KernelPrecompile:
    """Compiles recorded specializations on a thread pool as they are found; `finish()` returns once all are in their
    kernel's cache. While it runs, a launch of a specialization being compiled waits for it (Triton's
    AsyncCompileMode), so the engine may go on (load weights) meanwhile. Off (every method a no-op) on the CPU, with
    several ranks (every rank would have to fail alike in the passes), with threads 0, or a Triton without
    AsyncCompileMode (< 3.4) or none."""

    def __init__(self, runner, threads: int) -> None:
        self.runner, self.threads = runner, threads
        self.submitted: set[tuple[int, str]] = set()  # (kernel, specialization data) of each compile started
        self.pool = self.mode = None
        if runner.device.type != "cuda" or threads <= 0 or runner.groups.info.world_size > 1:
            return
        try:
            import triton
        except ImportError:  # the torch backend and ops: nothing to compile
            return
        if not hasattr(triton, "AsyncCompileMode"):
            return
        self.start = time.perf_counter()
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="triton-compile")
        mode = triton.AsyncCompileMode(self.pool, ignore_errors=True)  # a failed compile fails at its launch
        try:
            mode.__enter__()
        except RuntimeError:  # one is active in this thread already (an engine built inside another's start)
            self.pool.shutdown()
            return
        self.mode = mode

    def __enter__(self) -> KernelPrecompile:
        return self

    def __exit__(self, *exc) -> None:
        self.finish()

    def record(self, passes: Callable[[object], None]) -> None:
        """Records the specializations passes(runner) launches and starts compiling them."""
        if self.mode is None:
            return
        for fn, data in record_specializations(lambda: passes(self.runner)):
            if (id(fn), data) in self.submitted:  # (recorded again while being compiled)
                continue
            self.submitted.add((id(fn), data))
            try:
                fn.preload(data)
            except Exception as e:  # it compiles at its first launch instead (and reports there)
                logger.debug("kernel pre-compile: %s not submitted (%s: %s)", fn, type(e).__name__, e)

    def finish(self) -> None:
        """Waits until every submitted specialization is compiled and in its kernel's cache (once)."""
        if self.mode is None:
            return
        mode, self.mode = self.mode, None
        try:
            mode.__exit__(None, None, None)
        finally:
            self.pool.shutdown()
        logger.info(
            "compiled %d Triton kernel specializations on %d threads, %.2f s after the first was found",
            len(self.submitted),
            self.threads,
            time.perf_counter() - self.start,
        )


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


@torch.inference_mode()
def sampler_steps(runner) -> None:
    """The sampling kernel's variants (the longest compiles), from the model's config alone, before the model is
    built: logits in float32 with penalties and logprobs (what the profile and such requests run), and in the
    model's dtype without them (plain requests)."""
    from pagedllm.worker.gpu_memory import _sample_rules

    n, vocab = runner.config.scheduler.max_num_seqs, runner.config.model.vocab_size
    logits = torch.zeros(n, vocab, dtype=runner.config.model.dtype, device=runner.device)  # [n, vocab]
    _sample_rules(runner, logits.float())
    _plain_sample(runner, logits)


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
        _plain_sample(runner, runner.model.compute_logits(hidden[: sched.max_num_seqs], False))
        if runner.graphs is not None:
            for bs in runner.graphs.sizes:
                runner.graphs.clear_inputs()
                runner.graphs.forward_eager(bs)
        else:
            _dummy_prefill(runner, np.ones(sched.max_num_seqs, dtype=np.int64), num_blocks)  # decodes: 1 token each


def _plain_sample(runner, logits: torch.Tensor) -> None:
    """Temperature 1 without filters, penalties or logprobs: logits [n, vocab] stay in the model's dtype."""
    from pagedllm.sample.metadata import SamplingMetadata

    n = logits.shape[0]
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
    if runner.race is not None:  # the same rows as a racing step samples them
        runner.race.warm_up(logits)
