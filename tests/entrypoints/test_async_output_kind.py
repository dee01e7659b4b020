"""AsyncLLMEngine.generate streams as SamplingParams.output_kind asks: every DELTA reaches the reader in order (a slow
reader gets the ones it missed merged), and they concatenate to the cumulative result, with stop strings, n=2 and
logprobs; FINAL_ONLY yields one output. vLLM's v1 AsyncLLM streaming example runs with only `vllm` renamed. A tiny
random Llama with a character-level tokenizer (tests/char_tokenizer.py)."""

from __future__ import annotations

import asyncio

import pytest
from char_tokenizer import save_char_llama
from doc_scripts import run_script

from pagedllm import LLM, AsyncLLMEngine, SamplingParams
from pagedllm.sampling_params import RequestOutputKind

PROMPT = "The cat sat on"
SEEDED = dict(temperature=0.8, seed=11, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def char_model(tmp_path_factory) -> str:
    return save_char_llama("async_kind_llama", tmp_path_factory)


@pytest.fixture(scope="module")
def engine_and_reference(char_model):
    """The async engine, and LLM.generate's outputs (taken before the engine thread starts) for the cases."""
    llm = LLM(char_model, dtype="float32", kv_cache_memory_bytes=8 << 20)
    free = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].outputs[0].text
    assert len(free) >= 10, free
    cases = {
        "stop string": dict(temperature=0, max_tokens=30, stop=[free[6:9]]),
        "n=2, logprobs": dict(SEEDED, n=2, logprobs=2),
    }
    reference = {name: llm.generate(PROMPT, SamplingParams(**f), use_tqdm=False)[0] for name, f in cases.items()}
    engine = AsyncLLMEngine(llm)
    yield engine, cases, reference
    engine.shutdown()


async def collect(engine, params: SamplingParams, request_id: str, delay: float = 0.0) -> list:
    outs = []
    async for out in engine.generate(PROMPT, params, request_id):
        outs.append(out)
        await asyncio.sleep(delay)  # delay > 0: a reader slower than the engine
    return outs


def joined(deltas) -> dict[int, tuple]:
    seqs: dict[int, tuple] = {}
    for out in deltas:
        for c in out.outputs:
            text, ids, lps = seqs.get(c.index, ("", [], []))
            seqs[c.index] = (text + c.text, ids + list(c.token_ids), lps + (c.logprobs or []))
    return seqs


def whole(out) -> dict[int, tuple]:
    return {c.index: (c.text, list(c.token_ids), c.logprobs or []) for c in out.outputs}


@pytest.mark.parametrize("delay", [0.0, 0.1], ids=["reader keeps up", "slow reader"])
def test_deltas_concatenate_to_the_cumulative_result(engine_and_reference, delay):
    engine, cases, reference = engine_and_reference

    async def main():
        runs = []
        for name, fields in cases.items():
            delta = SamplingParams(**fields, output_kind=RequestOutputKind.DELTA)
            runs += [collect(engine, SamplingParams(**fields), f"{name}-c"), collect(engine, delta, name, delay)]
        return await asyncio.gather(*runs)

    results = asyncio.run(main())
    for i, name in enumerate(cases):
        cumulative, deltas = results[2 * i], results[2 * i + 1]
        assert cumulative[-1].finished and whole(cumulative[-1]) == whole(reference[name])
        assert deltas[-1].finished and not any(o.finished for o in deltas[:-1])
        assert all(o.request_id == name for o in deltas)
        assert joined(deltas) == whole(reference[name])
        if delay:  # the engine outran the reader: deltas it had not read came merged, none lost
            assert len(deltas) < len(reference[name].outputs[0].token_ids)
        ref = {c.index: c.cumulative_logprob for c in reference[name].outputs}
        last = {c.index: c.cumulative_logprob for c in deltas[-1].outputs}
        assert all(last[i] == ref[i] for i in last)  # cumulative_logprob stays cumulative
    stop = cases["stop string"]["stop"][0]
    assert reference["stop string"].outputs[0].stop_reason == stop
    assert stop not in "".join(o.outputs[0].text for o in results[1])


def test_final_only_yields_one_output(engine_and_reference):
    engine, cases, reference = engine_and_reference
    params = SamplingParams(**cases["n=2, logprobs"], output_kind=RequestOutputKind.FINAL_ONLY)
    outs = asyncio.run(collect(engine, params, "final"))
    assert len(outs) == 1 and outs[0].finished and whole(outs[0]) == whole(reference["n=2, logprobs"])


# vLLM's examples/offline_inference/async_llm_streaming.py, shortened: its imports and calls (DELTA streaming by
# keyword arguments to generate, stopping at the finished output, shutdown), fewer prompts and tokens
ASYNC_LLM_STREAMING = """
import asyncio

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine.async_llm import AsyncLLM


async def main():
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model="meta-llama/Llama-3.2-1B-Instruct", enforce_eager=True))
    try:
        for i, prompt in enumerate(["The future of AI is", "In a galaxy far away"]):
            params = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=42,
                                    output_kind=RequestOutputKind.DELTA)
            async for output in engine.generate(request_id=f"stream-{i}", prompt=prompt, sampling_params=params):
                for completion in output.outputs:
                    if completion.text:
                        print(completion.text, end="", flush=True)
                if output.finished:
                    print("|done")
                    break
    finally:
        engine.shutdown()


asyncio.run(main())
"""


def test_vllm_async_llm_streaming_example(char_model, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.05")  # the environment, not the script, sizes the cache
    out = run_script(ASYNC_LLM_STREAMING, {"meta-llama/Llama-3.2-1B-Instruct": char_model})
    assert out.count("|done") == 2
    llm = LLM(char_model, enforce_eager=True, kv_cache_memory_bytes=8 << 20)
    params = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=42)
    prompts = ["The future of AI is", "In a galaxy far away"]
    texts = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    assert out == "".join(f"{t}|done\n" for t in texts)


def test_shutdown_leaves_no_engine_thread(char_model):
    """shutdown() ends the engine thread and the preparation threads: a daemon thread still exiting while the
    interpreter finalizes could abort the process at exit ("terminate called without an active exception")."""
    import threading

    before = {t.ident for t in threading.enumerate()}
    engine = AsyncLLMEngine(LLM(char_model, dtype="float32", kv_cache_memory_bytes=8 << 20))
    outs = asyncio.run(collect(engine, SamplingParams(temperature=0, max_tokens=4), "t"))
    assert outs and outs[-1].finished
    engine.shutdown()
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.name.startswith("pagedllm-")]
    assert left == []


def test_generate_takes_prompt_dicts_as_add_request_does(char_model):
    """A prompt dict's cache_salt reaches the request (no prefix shared across salts); an unknown key and a
    priority other than 0 are errors, not ignored."""
    engine = AsyncLLMEngine(LLM(char_model, dtype="float32", kv_cache_memory_bytes=8 << 20))
    text = "the quick brown fox jumps over the lazy dog " * 2

    async def last(prompt, request_id, **kwargs):
        outs = [o async for o in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=2), request_id,
                                                 **kwargs)]  # fmt: skip
        return outs[-1]

    try:
        cached = [asyncio.run(last({"prompt": text, "cache_salt": s}, f"r{i}")).num_cached_tokens
                  for i, s in enumerate(["t1", "t2", "t1"])]  # fmt: skip
        assert cached[0] == 0 and cached[1] == 0 and cached[2] > 0, cached
        with pytest.raises(ValueError, match=r"prompt\.bogus: not supported"):
            asyncio.run(last({"prompt": text, "bogus": 1}, "x"))
        with pytest.raises(ValueError, match=r"priority=1: only first-come-first-served"):
            asyncio.run(last(text, "y", priority=1))
    finally:
        engine.shutdown()
