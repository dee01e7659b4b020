"""The torch profiler between a start and a stop (vLLM's LLM.start_profile / stop_profile and the server's
/start_profile, /stop_profile), enabled by VLLM_TORCH_PROFILER_DIR: the stop writes the trace into that directory
(`*.pt.trace.json`, for Perfetto, chrome://tracing or TensorBoard). An engine of several tensor/pipeline-parallel
ranks profiles every rank, each in its own process, into its own trace (`pagedllm-rank<N>` in the file name): a
rank that idles while its peers wait for it in a collective shows only in its own trace."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


class EngineProfiler:
    def __init__(self, trace_dir: str, worker_name: str = "pagedllm") -> None:
        self.trace_dir, self.worker_name = trace_dir, worker_name
        self.profiler: torch.profiler.profile | None = None

    def start(self) -> None:
        if self.profiler is not None:
            raise ValueError("the profiler is already running: stop it first (stop_profile)")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        handler = torch.profiler.tensorboard_trace_handler(self.trace_dir, worker_name=self.worker_name)
        self.profiler = torch.profiler.profile(activities=activities, on_trace_ready=handler, with_stack=False)
        self.profiler.start()
        logger.info("profiler started; traces go to %s", self.trace_dir)

    def stop(self) -> None:
        if self.profiler is None:
            raise ValueError("the profiler is not running: start it first (start_profile)")
        profiler, self.profiler = self.profiler, None
        profiler.stop()  # the trace handler writes the trace file
        logger.info("profiler stopped; trace written to %s", self.trace_dir)


class RanksProfiler:
    """Every rank of a multi-rank engine profiled at once: each rank's worker runs its own EngineProfiler (started
    and stopped through the executor, in the ranks' processes or Ray actors), writing its own trace. The checks come
    here, before any rank is asked: a worker whose call fails ends its process."""

    def __init__(self, executor, trace_dir: str) -> None:
        self.executor, self.trace_dir = executor, trace_dir
        self.running = False

    def start(self) -> None:
        if self.running:
            raise ValueError("the profiler is already running: stop it first (stop_profile)")
        self.executor._call("start_profile", self.trace_dir)
        self.running = True
        logger.info("profiler started on every rank; traces go to %s", self.trace_dir)

    def stop(self) -> None:
        if not self.running:
            raise ValueError("the profiler is not running: start it first (start_profile)")
        self.running = False
        self.executor._call("stop_profile")
        logger.info("profiler stopped on every rank; traces written to %s", self.trace_dir)


def engine_profiler(engine, trace_dir: str) -> EngineProfiler | RanksProfiler:
    """The profiler of `engine` (an LLMEngine or a pooling engine): every rank's when it has several."""
    executor = getattr(getattr(engine, "core", engine), "executor", None)  # (a pooling engine holds its own)
    if hasattr(executor, "_call"):  # a RanksExecutor (distributed/mp_executor.py, ray_executor.py)
        return RanksProfiler(executor, trace_dir)
    return EngineProfiler(trace_dir)


def profiler_from_env(engine) -> EngineProfiler | RanksProfiler:
    """engine_profiler writing to VLLM_TORCH_PROFILER_DIR; ValueError when the variable is unset."""
    from pagedllm import envs

    trace_dir = envs.torch_profiler_dir()
    if trace_dir is None:
        raise ValueError("profiling needs VLLM_TORCH_PROFILER_DIR: the directory the trace is written to")
    return engine_profiler(engine, trace_dir)
