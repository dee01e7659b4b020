"""LoRA end to end against PEFT: adapters made with the peft package on tiny random Llama and Qwen2 models; the
oracle is PEFT's merged model in HF transformers (greedy float32 tokens identical, logprobs close)."""

from __future__ import annotations

import functools

import pytest
from tiny_models import hf_greedy

from pagedllm import LLM, LoRARequest, SamplingParams

PROMPTS = [[5, 17, 42, 7, 99, 3], [11, 200, 13, 8], list(range(40, 61))]  # the last spans more than one KV block
MAX_TOKENS = 6
SP = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="session")
def lora_llm(lora_family):
    """max_loras=2 slots and max_cpu_loras=2 host copies for 4 adapters: a mixed batch queues adapters and reads
    evicted ones again from their folders."""
    _, base_path, _, _ = lora_family
    return LLM(
        base_path, dtype="float32", device="cpu", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22,
        enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2, max_num_seqs=8,
    )  # fmt: skip


def lora_requests(lora_family) -> dict[str, LoRARequest]:
    _, _, _, adapters = lora_family
    return {name: LoRARequest(name, i + 1, path) for i, (name, (path, _)) in enumerate(adapters.items())}


@functools.cache
def _oracle(key, model, prompt: tuple) -> tuple[list[int], list[float]]:
    return hf_greedy(model, list(prompt), MAX_TOKENS)


def oracle(lora_family, name: str | None, prompt: list[int]):
    arch, _, hf, adapters = lora_family
    model = hf if name is None else adapters[name][1]
    return _oracle((arch, name), model, tuple(prompt))


def tokens_and_logprobs(out):
    comp = out.outputs[0]
    return comp.token_ids, [lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids)]


def test_each_adapter_matches_peft_merged_model(lora_family, lora_llm):
    reqs = lora_requests(lora_family)
    for name, req in reqs.items():
        outs = lora_llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SP, use_tqdm=False, lora_request=req)
        for prompt, out in zip(PROMPTS, outs):
            tokens, logprobs = tokens_and_logprobs(out)
            ref_tokens, ref_logprobs = oracle(lora_family, name, prompt)
            assert tokens == ref_tokens, (name, prompt)
            assert logprobs == pytest.approx(ref_logprobs, abs=1e-4), (name, prompt)
    base_ref = oracle(lora_family, None, PROMPTS[0])[0]
    assert any(oracle(lora_family, name, PROMPTS[0])[0] != base_ref for name in reqs), "adapters change outputs"


def test_mixed_batch_gives_each_row_what_it_gives_alone(lora_family, lora_llm):
    """4 adapters and base rows in one generate call with 2 slots: rows queue for a slot, never fail."""
    reqs = lora_requests(lora_family)
    rows = [(name, PROMPTS[i % len(PROMPTS)]) for i, name in enumerate([*reqs, None, *reqs, None])]
    outs = lora_llm.generate(
        [{"prompt_token_ids": p} for _, p in rows],
        SP,
        use_tqdm=False,
        lora_request=[None if name is None else reqs[name] for name, _ in rows],
    )
    for (name, prompt), out in zip(rows, outs):
        assert out.outputs[0].token_ids == oracle(lora_family, name, prompt)[0], (name, prompt)


def test_adapters_never_share_prefix_cache_blocks(lora_family, lora_llm):
    reqs = list(lora_requests(lora_family).values())
    prompt = [{"prompt_token_ids": list(range(100, 137))}]  # two full blocks of 16 and more
    lora_llm.reset_prefix_cache()
    first = lora_llm.generate(prompt, SP, use_tqdm=False, lora_request=reqs[0])[0]
    other = lora_llm.generate(prompt, SP, use_tqdm=False, lora_request=reqs[1])[0]
    base = lora_llm.generate(prompt, SP, use_tqdm=False)[0]
    again = lora_llm.generate(prompt, SP, use_tqdm=False, lora_request=reqs[0])[0]
    assert (first.num_cached_tokens, other.num_cached_tokens, base.num_cached_tokens) == (0, 0, 0)
    assert again.num_cached_tokens == 32
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.outputs[0].token_ids == oracle(lora_family, reqs[1].lora_name, prompt[0]["prompt_token_ids"])[0]


def test_lora_requests_info_metric(lora_family, lora_llm):
    """vLLM's gauge: the running and waiting adapters by name, and max_lora."""
    reqs = list(lora_requests(lora_family).values())
    engine = lora_llm.llm_engine
    for i, lora in enumerate(reqs[:3]):
        engine.add(*engine.make_request(None, [1, 2, 3], SP, request_id=f"m{i}", lora_request=lora))
    engine.step()
    info = next(m for m in lora_llm.get_metrics() if m.name == "vllm:lora_requests_info")
    assert info.labels == {
        "max_lora": "2",
        "running_lora_adapters": ",".join(sorted(r.lora_name for r in reqs[:2])),
        "waiting_lora_adapters": reqs[2].lora_name,
    }
    while engine.has_unfinished_requests():
        engine.step()
