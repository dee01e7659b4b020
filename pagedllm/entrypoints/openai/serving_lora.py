"""Adapters loaded and unloaded while the server runs (vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter).
They read folders named in requests, so the routes exist only when VLLM_ALLOW_RUNTIME_LORA_UPDATING (or
PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING) is set to 1/true (pagedllm/envs.py), as in vLLM."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from pagedllm import envs
from pagedllm.entrypoints.openai.protocol import APIError, _Request, from_value_error
from pagedllm.entrypoints.openai.serving_utils import ServerState, bad


class LoadLoRAAdapterRequest(_Request):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Request):
    lora_name: str
    lora_int_id: int | None = None


def add_lora_routes(app: FastAPI, state: ServerState) -> None:
    if not envs.allow_runtime_lora_updating():
        return

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> PlainTextResponse:
        return PlainTextResponse(await load(state, req))

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        return PlainTextResponse(await unload(state, req))


async def load(state: ServerState, req: LoadLoRAAdapterRequest) -> str:
    from pagedllm.lora.request import LoRARequest

    name = req.lora_name
    if not name or not req.lora_path:
        raise bad("lora_name and lora_path must be non-empty", "lora_name" if not name else "lora_path")
    if name in state.lora_modules or name in state.served_model_names:
        raise bad(f"lora_name={name!r} is already served", "lora_name")
    ids = [r.lora_int_id for r in state.lora_modules.values()]
    engine = state.engine.engine
    lora = LoRARequest(name, max([*ids, *engine.list_loras(), 0]) + 1, req.lora_path)
    try:
        await state.engine.call(engine.add_lora, lora)  # on the engine thread, between steps
    except (ValueError, TypeError) as e:
        raise from_value_error(e, "lora_path") from None
    state.lora_modules[name] = lora
    return f"Success: LoRA adapter '{name}' added successfully."


async def unload(state: ServerState, req: UnloadLoRAAdapterRequest) -> str:
    lora = state.lora_modules.get(req.lora_name)
    if lora is None or (req.lora_int_id is not None and req.lora_int_id != lora.lora_int_id):
        raise APIError(f"The lora adapter '{req.lora_name}' cannot be found.", 404, param="lora_name")
    del state.lora_modules[req.lora_name]  # new requests cannot name it; those in flight finish with it
    await state.engine.call(state.engine.engine.remove_lora, lora.lora_int_id)
    return f"Success: LoRA adapter '{req.lora_name}' removed successfully."
