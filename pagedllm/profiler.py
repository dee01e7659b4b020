"""The torch profiler between a start and a stop (vLLM's LLM.start_profile / stop_profile and the server's
/start_profile, /stop_profile), enabled by VLLM_TORCH_PROFILER_DIR: the stop writes the trace into that directory
(`*.pt.trace.json`, for Perfetto, chrome://tracing or TensorBoard)."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


class EngineProfiler:
    def __init__(self, trace_dir: str) -> None:
        self.trace_dir = trace_dir
        self.profiler: torch.profiler.profile | None = None

    def start(self) -> None:
        if self.profiler is not None:
            raise ValueError("the profiler is already running: stop it first (stop_profile)")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        handler = torch.profiler.tensorboard_trace_handler(self.trace_dir, worker_name="pagedllm")
        self.profiler = torch.profiler.profile(activities=activities, on_trace_ready=handler, with_stack=False)
        self.profiler.start()
        logger.info("profiler started; traces go to %s", self.trace_dir)

    def stop(self) -> None:
        if self.profiler is None:
            raise ValueError("the profiler is not running: start it first (start_profile)")
        profiler, self.profiler = self.profiler, None
        profiler.stop()  # the trace handler writes the trace file
        logger.info("profiler stopped; trace written to %s", self.trace_dir)


def profiler_from_env() -> EngineProfiler:
    """A profiler writing to VLLM_TORCH_PROFILER_DIR; ValueError when the variable is unset."""
    from pagedllm import envs

    trace_dir = envs.torch_profiler_dir()
    if trace_dir is None:
        raise ValueError("profiling needs VLLM_TORCH_PROFILER_DIR: the directory the trace is written to")
    return EngineProfiler(trace_dir)
