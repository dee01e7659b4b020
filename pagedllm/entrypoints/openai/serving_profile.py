"""POST /start_profile and /stop_profile, only when VLLM_TORCH_PROFILER_DIR is set (as vLLM): the torch profiler
runs on the engine's thread between the two calls, and /stop_profile writes its trace into that directory
(`*.pt.trace.json`, for Perfetto, chrome://tracing or TensorBoard)."""

from __future__ import annotations

import logging

import torch
from fastapi import FastAPI
from fastapi.responses import Response

from pagedllm import envs
from pagedllm.entrypoints.openai.serving_utils import ServerState, bad

logger = logging.getLogger(__name__)


class EngineProfiler:
    def __init__(self, trace_dir: str) -> None:
        self.trace_dir = trace_dir
        self.profiler: torch.profiler.profile | None = None

    def start(self) -> None:
        if self.profiler is not None:
            raise ValueError("the profiler is already running: POST /stop_profile first")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        handler = torch.profiler.tensorboard_trace_handler(self.trace_dir, worker_name="pagedllm")
        self.profiler = torch.profiler.profile(activities=activities, on_trace_ready=handler, with_stack=False)
        self.profiler.start()
        logger.info("profiler started; traces go to %s", self.trace_dir)

    def stop(self) -> None:
        if self.profiler is None:
            raise ValueError("the profiler is not running: POST /start_profile first")
        profiler, self.profiler = self.profiler, None
        profiler.stop()  # the trace handler writes the trace file
        logger.info("profiler stopped; trace written to %s", self.trace_dir)


def add_profile_routes(app: FastAPI, state: ServerState) -> None:
    trace_dir = envs.torch_profiler_dir()
    if trace_dir is None:
        return
    profiler = EngineProfiler(trace_dir)

    async def run(fn) -> Response:
        try:
            await state.engine.call(fn)
        except ValueError as e:
            raise bad(str(e)) from None
        return Response(status_code=200)

    async def start_profile() -> Response:
        return await run(profiler.start)

    async def stop_profile() -> Response:
        return await run(profiler.stop)

    app.add_api_route("/start_profile", start_profile, methods=["POST"])
    app.add_api_route("/stop_profile", stop_profile, methods=["POST"])
