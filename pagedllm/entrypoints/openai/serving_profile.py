"""POST /start_profile and /stop_profile, only when VLLM_TORCH_PROFILER_DIR is set (as vLLM): the torch profiler
runs on the engine's thread between the two calls, and /stop_profile writes its trace into that directory
(`*.pt.trace.json`, for Perfetto, chrome://tracing or TensorBoard; one per rank with several ranks)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import Response

from pagedllm import envs
from pagedllm.entrypoints.openai.serving_utils import ServerState, bad
from pagedllm.profiler import engine_profiler


def add_profile_routes(app: FastAPI, state: ServerState) -> None:
    trace_dir = envs.torch_profiler_dir()
    if trace_dir is None:
        return
    profiler = engine_profiler(state.engine.engine, trace_dir)  # every rank's with several

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
