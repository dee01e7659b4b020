"""The bundled SmolLM2-135M-Instruct GGUF end to end: greedy tokens identical to HF transformers loading the same
file (float32), in one batch, under preemption and under chunked prefill."""

from __future__ import annotations

import os

import pytest
import torch

from pagedllm import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Explain why the sky is blue in one sentence.",
    "1, 2, 3, 4, 5,",
    "Translate to French: I like apples.",
    "The best way to learn a new language is",
    "Q: What is the boiling point of water?\nA:",
    "List three fruits:",
    "In 1969, humans",
    "Hello! My name is",
    "A haiku about autumn leaves:",
    "import numpy as np\nx = np.",
    "The quick brown fox",
]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def hf_reference(smollm2_hf_copy):
    """HF transformers' greedy continuation of each prompt, one prompt at a time (no padding), float32."""
    smollm2_hf_copy.generation_config.eos_token_id = None  # all max_new_tokens, as with ignore_eos
    return smollm2_hf_copy


@pytest.fixture(scope="module")
def llm(smollm2):
    return LLM(smollm2, dtype="float32", kv_cache_memory_bytes=256 << 20)


@pytest.fixture(scope="module")
def reference_tokens(llm, hf_reference):
    tok = llm.get_tokenizer()
    refs = []
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        with torch.no_grad():
            out = hf_reference.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
        refs.append(out[0, len(ids) :].tolist())
    return refs


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _check(outputs, reference_tokens):
    assert len(outputs) == len(PROMPTS)
    for prompt, out, ref in zip(PROMPTS, outputs, reference_tokens):
        assert out.prompt == prompt
        assert out.outputs[0].token_ids == ref, prompt
        assert out.outputs[0].finish_reason == "length"


def test_prompt_tokens_match_hf_tokenizer(llm, smollm2):
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(os.path.dirname(smollm2), gguf_file=os.path.basename(smollm2))
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, SamplingParams(max_tokens=1), use_tqdm=False)):
        assert out.prompt_token_ids == hf_tok.encode(prompt)


def test_greedy_batch_equals_hf(llm, reference_tokens):
    _check(llm.generate(PROMPTS, GREEDY, use_tqdm=False), reference_tokens)


def test_text_is_detokenized_tokens(llm):
    tok = llm.get_tokenizer()
    for out in llm.generate(PROMPTS[:6], GREEDY, use_tqdm=False):
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)


def test_greedy_equals_hf_under_preemption(smollm2, reference_tokens):
    # 16 requests need ~16 * 3 blocks of 16 tokens; 20 blocks force the scheduler to preempt and recompute.
    small = LLM(smollm2, dtype="float32", num_gpu_blocks_override=20)
    outputs = small.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert small.llm_engine.core.scheduler.num_preemptions > 0
    _check(outputs, reference_tokens)


def test_greedy_equals_hf_with_chunked_prefill(smollm2, reference_tokens):
    chunked = LLM(smollm2, dtype="float32", max_num_batched_tokens=16, kv_cache_memory_bytes=256 << 20)
    _check(chunked.generate(PROMPTS, GREEDY, use_tqdm=False), reference_tokens)


def test_eos_stops_with_stop_reason(llm):
    out = llm.generate(
        ["<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"],
        SamplingParams(temperature=0, max_tokens=200),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids[-1] == llm.get_tokenizer().eos_token_id
    assert len(out.token_ids) < 200
