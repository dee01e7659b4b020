"""vLLM's engine API of its examples: `LLMEngine.from_engine_args(EngineArgs(...))`, `add_request(id, prompt, params)`
with a text, a prompt dict or token ids, `step()` until `has_unfinished_requests()` is false, `abort_request`,
`get_num_unfinished_requests`, `get_model_config`, `get_tokenizer`: the same tokens as `LLM.generate`."""

from __future__ import annotations

from pagedllm import LLM, EngineArgs, LLMEngine, SamplingParams

PROMPTS = ["A robot may not injure a human being", "To be or not to be,", "What is the meaning of life?"]


def test_llm_engine_example_loop(smollm2):
    kwargs = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=16 << 20)
    engine = LLMEngine.from_engine_args(EngineArgs(model=smollm2, **kwargs))
    assert engine.get_model_config().max_model_len == 256 and engine.get_tokenizer() is not None
    assert engine.vllm_config.model_config is engine.get_model_config()  # vLLM's names of the configs
    assert engine.engine_config.scheduler_config is engine.config.scheduler  # as vLLM's spec_decode example
    assert engine.vllm_config.cache_config is engine.config.cache and engine.vllm_config.lora_config is None
    from pagedllm.config import VllmConfig  # vLLM's name of the type, as its logits processor examples import it

    assert isinstance(engine.vllm_config, VllmConfig) and engine.model_config is engine.get_model_config()
    params = SamplingParams(temperature=0.0, max_tokens=8)
    queue = [(PROMPTS[0], params), ({"prompt": PROMPTS[1]}, params)]
    queue.append(({"prompt_token_ids": engine.get_tokenizer().encode(PROMPTS[2])}, params))
    queue.append(("never finishes", SamplingParams(max_tokens=200, ignore_eos=True)))
    finished, request_id = {}, 0
    while True:  # vLLM's llm_engine_example.py, with an abort
        if queue:
            prompt, sampling_params = queue.pop(0)
            engine.add_request(str(request_id), prompt, sampling_params)
            request_id += 1
        if request_id == 4 and "3" not in finished:
            assert engine.get_num_unfinished_requests() >= 1
            engine.abort_request("3")
            finished["3"] = None
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        if not (engine.has_unfinished_requests() or queue):
            break
    assert engine.get_num_unfinished_requests() == 0
    expected = LLM(smollm2, **kwargs).generate(PROMPTS, params, use_tqdm=False)
    for i, want in enumerate(expected):
        assert finished[str(i)].outputs[0].token_ids == want.outputs[0].token_ids
    assert finished[str(2)].prompt_token_ids == expected[2].prompt_token_ids


def test_request_output_metrics(smollm2):
    """RequestOutput.metrics: wall-clock milestones in order, as vLLM's RequestMetrics."""
    import time

    start = time.time()
    llm = LLM(smollm2, dtype="float32", max_model_len=256, kv_cache_memory_bytes=16 << 20)
    out = llm.generate("Hello", SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    m = out.metrics
    assert start <= m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time
    assert m.last_token_time <= m.finished_time <= time.time()
    assert abs(m.time_in_queue - (m.first_scheduled_time - m.arrival_time)) < 1e-6


def test_async_llm_engine(smollm2):
    """vLLM's async example: concurrent generate() streams equal LLM.generate; abort() ends a stream early."""
    import asyncio

    from pagedllm import AsyncEngineArgs, AsyncLLMEngine

    kwargs = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=16 << 20)
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=smollm2, **kwargs))
    params = SamplingParams(temperature=0.0, max_tokens=8)

    async def run(prompt: str, request_id: str) -> list:
        return [out async for out in engine.generate(prompt, params, request_id)]

    async def aborted() -> list:
        seen = []
        async for out in engine.generate("Count to a hundred:", SamplingParams(max_tokens=200, ignore_eos=True), "x"):
            seen.append(out)
            if len(seen) == 2:
                await engine.abort("x")
        return seen

    async def main():
        return await asyncio.gather(run(PROMPTS[0], "a"), run(PROMPTS[1], "b"), aborted())

    try:
        first, second, cut = asyncio.run(main())
        assert asyncio.run(engine.get_model_config()).max_model_len == 256
    finally:
        engine.shutdown()
    expected = LLM(smollm2, **kwargs).generate(PROMPTS[:2], params, use_tqdm=False)
    for outs, want, rid in ((first, expected[0], "a"), (second, expected[1], "b")):
        assert all(o.request_id == rid for o in outs) and outs[-1].finished and not outs[0].finished
        assert outs[-1].outputs[0].token_ids == want.outputs[0].token_ids
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        assert lengths == sorted(lengths)  # cumulative
    assert len(cut) == 2 and not cut[-1].finished
