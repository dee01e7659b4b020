"""The model runner keeps the LM head's bfloat16 logits (no float32 copy) on steps where every row takes the argmax
and nothing else reads them: the C argmax (CPU) and torch's (GPU) read them exactly, so the tokens are those of the
float32 copy. On the GPU such a step builds none of the sampling kernel's inputs."""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import TINY_DECODER, save_tiny_decoder

from pagedllm import LLM, SamplingParams
from pagedllm.kernels import cpu_kernels, triton_available


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    _, path = save_tiny_decoder(
        "llama", transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(TINY_DECODER), tmp_path_factory
    )
    return path


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not triton_available(), reason="the GPU sampler needs triton")],
        ),
    ],
)
def test_greedy_steps_keep_bfloat16_logits_and_the_same_tokens(tiny_llama, device, monkeypatch):
    if device == "cpu" and cpu_kernels.compiled() is None:
        pytest.fail("pagedllm.kernels.cpu_kernels did not build: it needs a C compiler (GCC 12+ or clang)")
    gen = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(0, 320, (n,), generator=gen).tolist()} for n in (1, 7, 19, 4)]
    llm = LLM(
        tiny_llama, dtype="bfloat16", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24, block_size=4,
        device=device,
    )  # fmt: skip
    runner = llm.llm_engine.core.executor.runner
    upcasts, kernel_inputs = [], []
    prepare = runner.sampler.prepare

    def recording_prepare(*args, **kwargs):
        step = prepare(*args, **kwargs)
        kernel_inputs.append(step.meta)
        return step

    monkeypatch.setattr(runner.sampler, "prepare", recording_prepare)
    compute_logits = runner.model.compute_logits
    monkeypatch.setattr(
        runner.model, "compute_logits", lambda h, upcast=True: upcasts.append(upcast) or compute_logits(h, upcast)
    )

    def tokens(**params) -> list[list[int]]:
        sp = SamplingParams(max_tokens=12, ignore_eos=True, **params)
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]

    greedy = tokens(temperature=0)
    assert upcasts and not any(upcasts), "a greedy step made a float32 copy of the logits"
    if device == "cuda":  # torch's argmax: no sampling kernel inputs built or uploaded
        assert kernel_inputs and all(m.all_greedy and m.device_inputs is None for m in kernel_inputs)
    upcasts.clear()
    kernel_inputs.clear()
    tokens(temperature=0, logprobs=2)  # the logprobs read float32 rows
    tokens(temperature=0, repetition_penalty=1.2)  # the penalties change float32 rows (GPU: copies of them)
    if device == "cpu":
        tokens(temperature=0.8, seed=1)  # the C kernels draw from float32 rows
    assert upcasts and all(upcasts), "a step that reads float32 logits kept them in bfloat16"
    if device == "cuda":  # the sampling kernel reads bfloat16 rows exactly
        upcasts.clear()
        tokens(temperature=0.8, seed=1)
        assert upcasts and not any(upcasts), "a sampling step on the GPU made a float32 copy of the logits"
    inputs = [m.params if device == "cpu" else m.device_inputs for m in kernel_inputs]
    assert all(i is not None for i in inputs), "a step that needs the kernels built no inputs for them"
    monkeypatch.setattr(runner.sampler, "needs_float32", lambda *a: True)
    assert tokens(temperature=0) == greedy
