"""vLLM's AsyncLLMEngine (and v1 AsyncLLM) for asyncio programs:
`AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=...))`, `generate(prompt, params, request_id)` and
`encode(...)` as async generators, `abort(id)`, `shutdown()`. generate streams as the params' output_kind asks:
cumulative outputs (the default), deltas (every one reaches the reader; those it has not yet taken come merged into
one), or only the final output.

The engine runs on its own thread (the server's AsyncEngine): steps never block the event loop, and many
generate() calls at once are batched together."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from pagedllm.engine.arg_utils import AsyncEngineArgs
from pagedllm.engine.llm_engine import check_request_keywords
from pagedllm.engine_args import EngineArgs
from pagedllm.entrypoints.openai.async_engine import AsyncEngine, RequestStream
from pagedllm.multimodal.inputs import ProcessedPair
from pagedllm.outputs import RequestOutput
from pagedllm.prompt_embeds import EmbedsPair
from pagedllm.sampling_params import SamplingParams

__all__ = ["AsyncEngineArgs", "AsyncLLMEngine"]


class AsyncLLMEngine:
    def __init__(self, llm) -> None:
        self.llm = llm
        self.engine = AsyncEngine(llm)
        self.engine.start()
        self._streams: dict[str, tuple[RequestStream, str]] = {}  # user request id -> (stream, engine request id)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> AsyncLLMEngine:
        from pagedllm import LLM

        values = {f.name: getattr(engine_args, f.name) for f in dataclasses.fields(EngineArgs)}
        return cls(LLM(values.pop("model"), **values))

    async def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams,
        request_id: str,
        lora_request: Any = None,
        trace_headers: Any = None,
        priority: int = 0,
        tokenization_kwargs: dict | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's output after each step that gave it tokens, as sampling_params.output_kind asks
        (cumulative, the deltas, or the final output only); the last has finished=True. `prompt` as
        LLMEngine.add_request takes it (a prompt dict's cache_salt, multi_modal_data and prompt_embeds too)."""
        if request_id in self._streams:
            raise ValueError(f"request_id={request_id!r} is already in use")
        check_request_keywords(priority, trace_headers)
        core = self.engine.engine

        def make_prompts() -> list:  # (in a preparation thread; prompt_parts checks the dict, its cache_salt too)
            text, ids, features, _, embeds = core.prompt_parts(prompt, None, tokenization_kwargs)
            if embeds is not None:
                return [EmbedsPair(embeds)]
            return [ProcessedPair(text, ids, features) if features else (text, ids)]

        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        stream = await self.engine.generate(make_prompts, 1, sampling_params, request_id, cache_salt=salt,
                                            lora_request=lora_request)  # fmt: skip
        self._streams[request_id] = (stream, f"{request_id}-0")
        try:
            async with stream:
                async for _, out in stream:
                    yield dataclasses.replace(out, request_id=request_id)
        finally:
            self._streams.pop(request_id, None)

    async def encode(self, prompt: Any, pooling_params: Any = None, request_id: str | None = None, **kwargs: Any):
        """A pooling model's output (one, finished) as an async generator, as vLLM's encode."""
        outputs = await self.engine.call(self.llm.encode, prompt, pooling_params, use_tqdm=False, **kwargs)
        for out in outputs:
            yield out

    async def abort(self, request_id: str | list[str]) -> None:
        """Ends the requests: their generate() loops stop without a finished output."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            found = self._streams.pop(rid, None)
            if found is not None:
                stream, engine_id = found
                self.engine.abort([engine_id])
                stream.unfinished.clear()
                stream.ready.set()  # wakes the generate() loop, which then ends

    async def get_model_config(self):
        return self.llm.llm_engine.config.model

    async def get_tokenizer(self):
        return self.llm.get_tokenizer()

    def shutdown(self) -> None:
        self.engine.stop()
