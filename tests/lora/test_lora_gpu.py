"""LoRA on the GPU: a batch mixing 4 adapters and base rows decodes through the CUDA graphs (captured with the LoRA
path on) and gives PEFT's merged-model tokens and the eager engine's logprobs; with TP=2 and PP=2 too (on 2
GPUs). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from tiny_models import hf_greedy

from pagedllm import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.gpu
PROMPTS = [[5, 17, 42, 7, 99, 3], [11, 200, 13, 8], list(range(40, 61))]
SP = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)


def _generate(path: str, rows, reqs, **kwargs):
    llm = LLM(
        path, dtype="float32", device="cuda", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24,
        enable_lora=True, max_loras=4, max_lora_rank=16, max_num_seqs=8, **kwargs,
    )  # fmt: skip
    try:
        loras = [None if name is None else reqs[name] for name, _ in rows]
        outs = llm.generate([{"prompt_token_ids": p} for _, p in rows], SP, use_tqdm=False, lora_request=loras)
        graphs = llm.llm_engine.core.executor.runner.graphs
    finally:
        llm.llm_engine.shutdown()
    summary = [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
               for o in outs]  # fmt: skip
    return summary, graphs.num_replays if graphs is not None else 0


def _rows(lora_family):
    _, _, _, adapters = lora_family
    reqs = {name: LoRARequest(name, i + 1, path) for i, (name, (path, _)) in enumerate(adapters.items())}
    return [(name, PROMPTS[i % len(PROMPTS)]) for i, name in enumerate([*reqs, None, *reqs])], reqs


def _assert_peft_tokens(lora_family, rows, outs) -> None:
    _, _, hf, adapters = lora_family
    for (name, prompt), (tokens, _) in zip(rows, outs):
        model = hf if name is None else adapters[name][1]
        assert tokens == hf_greedy(model, prompt, SP.max_tokens)[0], (name, prompt)


def test_mixed_adapters_replay_graphs_and_match_peft(lora_family):
    rows, reqs = _rows(lora_family)
    graphed, replays = _generate(lora_family[1], rows, reqs)
    eager, _ = _generate(lora_family[1], rows, reqs, enforce_eager=True)
    assert replays > 0, "decode steps with adapters ran eagerly"
    _assert_peft_tokens(lora_family, rows, graphed)
    for (name, prompt), (_, logprobs), (_, eager_logprobs) in zip(rows, graphed, eager):
        assert logprobs == pytest.approx(eager_logprobs, abs=1e-3), (name, prompt)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)], ids=str)
def test_parallel_graphs_match_peft(lora_family, parallel):
    rows, reqs = _rows(lora_family)
    outs, replays = _generate(lora_family[1], rows, reqs, **parallel)
    assert replays > 0
    _assert_peft_tokens(lora_family, rows, outs)


def test_steps_of_any_size_run_the_variants_compiled_at_start(lora_family):
    """Steps of other token and block counts than the first ones (a prefix-cache hit's short prefill, mixed batches
    of several adapters) launch the LoRA kernels compiled before them: no compile while serving."""
    from pagedllm.kernels.lora import lora_expand_kernel, lora_shrink_kernel

    rows, reqs = _rows(lora_family)
    llm = LLM(
        lora_family[1], dtype="float32", device="cuda", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24,
        enable_lora=True, max_loras=4, max_lora_rank=16, max_num_seqs=8,
    )  # fmt: skip

    def variants() -> int:
        device = torch.cuda.current_device()
        return sum(len(k.device_caches[device][0]) for k in (lora_shrink_kernel, lora_expand_kernel))

    try:
        name, prompt = rows[0]
        llm.generate([{"prompt_token_ids": prompt * 8}], SP, use_tqdm=False, lora_request=reqs[name])
        before = variants()
        loras = [None if n is None else reqs[n] for n, _ in rows]
        llm.generate([{"prompt_token_ids": p} for _, p in rows], SP, use_tqdm=False, lora_request=loras)  # mixed
        llm.generate([{"prompt_token_ids": prompt * 8}], SP, use_tqdm=False, lora_request=reqs[name])  # cached
        assert variants() == before
    finally:
        llm.llm_engine.shutdown()
