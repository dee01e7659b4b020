"""Beam search over HTTP (`use_beam_search` with `best_of` beams, `length_penalty`, `early_stopping`): the offline
algorithm (pagedllm.beam_search.run_beam_search, so the server's beams equal LLM's) runs in a thread of its own, and
each of its one-token steps goes through the async engine as ordinary requests, between the other requests' steps.
The answer comes whole at the end: streaming, logprobs and prompt_logprobs are refused with it."""

from __future__ import annotations

import asyncio
import threading

from pagedllm.beam_search import BeamSearchParams, run_beam_search
from pagedllm.entrypoints.openai.async_engine import AsyncEngine, CheckFn, PromptsFn
from pagedllm.entrypoints.openai.serving_utils import bad
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams


def refuse_with_beam_search(stream: bool, logprobs: object, prompt_logprobs: object) -> None:
    for name, value in (("stream", stream), ("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if value:
            raise bad(f"{name} is not available with use_beam_search (the beams come whole at the end)", name)


class _EngineSteps:
    """What run_beam_search needs of an LLM, for a thread that is not the event loop's: generate() runs one beam
    step through the async engine and waits for it."""

    def __init__(self, engine: AsyncEngine, loop: asyncio.AbstractEventLoop, request_id: str) -> None:
        self.engine, self.loop, self.request_id = engine, loop, request_id
        self.llm_engine = engine.engine
        self.num_steps = 0
        self.cancelled = threading.Event()

    def get_tokenizer(self):
        return self.engine.llm.get_tokenizer()

    def generate(self, prompts: list[list[int]], params: SamplingParams, use_tqdm: bool = False, lora_request=None):
        if self.cancelled.is_set():
            raise asyncio.CancelledError()
        self.num_steps += 1
        lora = lora_request[0] if isinstance(lora_request, list) else lora_request  # one adapter for the request
        step = asyncio.run_coroutine_threadsafe(self._step(prompts, params, lora), self.loop)
        return step.result()

    async def _step(self, prompts: list[list[int]], params: SamplingParams, lora=None) -> list[RequestOutput]:
        items = [(None, ids) for ids in prompts]
        rid = f"{self.request_id}-beam{self.num_steps}"
        stream = await self.engine.generate(lambda: items, len(items), params, rid, lora_request=lora)
        finals: dict[int, RequestOutput] = {}
        async with stream:
            async for index, out in stream:
                finals[index] = out
        return [finals[i] for i in range(len(items))]


async def beam_search(
    engine: AsyncEngine,
    make_prompts: PromptsFn,
    params: SamplingParams,
    request_id: str,
    check: CheckFn,
    cache_salt: str | None,
    lora_request=None,
) -> list[RequestOutput]:
    """One RequestOutput per prompt: its `n` best of `best_of` beams, best first."""

    def checked() -> list[tuple[str | None, list[int]]]:
        prompts = make_prompts()
        if any(getattr(p, "mm_features", None) for p in prompts):
            raise ValueError("use_beam_search: beam search takes text prompts only (no images)")
        check(prompts)
        for i, (text, ids) in enumerate(prompts):  # the engine's checks of any request
            engine.engine.make_request(
                text, ids, params, f"{request_id}-check{i}", cache_salt=cache_salt, lora_request=lora_request
            )
        return prompts

    prompts = await engine.prepare(checked)
    beam = BeamSearchParams(
        beam_width=params.best_of or params.n,
        max_tokens=params.max_tokens or 16,
        ignore_eos=params.ignore_eos,
        length_penalty=params.length_penalty,
        early_stopping=params.early_stopping,
    )
    steps = _EngineSteps(engine, asyncio.get_running_loop(), request_id)
    try:
        loras = None if lora_request is None else [lora_request] * len(prompts)
        found = await engine.run_in_thread(run_beam_search, steps, [ids for _, ids in prompts], beam, 0, loras)
    finally:
        steps.cancelled.set()  # a client that went away stops the search at its next step
    return [
        _output(f"{request_id}-{i}", text, ids, out, params.n)
        for i, ((text, ids), out) in enumerate(zip(prompts, found))
    ]


def _output(request_id: str, text: str | None, ids: list[int], found, n: int) -> RequestOutput:
    outputs = [
        CompletionOutput(
            index=i,
            text=s.text or "",
            token_ids=s.tokens[len(ids) :],
            cumulative_logprob=s.cum_logprob,
            finish_reason=s.finish_reason,
        )
        for i, s in enumerate(found.sequences[:n])
    ]
    return RequestOutput(request_id=request_id, prompt=text, prompt_token_ids=ids, outputs=outputs, finished=True)
