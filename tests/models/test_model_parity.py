"""Tiny random-weight models of each architecture: pagedllm's logits and greedy tokens against HF transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from tiny_models import TINY_DECODER, save_tiny_decoder

from pagedllm import LLM, SamplingParams
from pagedllm.attention.common import BatchLayout
from pagedllm.forward_context import forward_context

CASES = {
    "llama": (transformers.LlamaConfig, dict(TINY_DECODER)),
    "llama3-rope-tied": (
        transformers.LlamaConfig,
        dict(
            TINY_DECODER,
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "mistral-sliding": (transformers.MistralConfig, dict(TINY_DECODER, sliding_window=8, head_dim=32)),
    "qwen2-bias": (transformers.Qwen2Config, dict(TINY_DECODER, num_key_value_heads=1)),
    "qwen3-qknorm": (transformers.Qwen3Config, dict(TINY_DECODER, head_dim=24)),
}
ARCH = {
    transformers.LlamaConfig: transformers.LlamaForCausalLM,
    transformers.MistralConfig: transformers.MistralForCausalLM,
    transformers.Qwen2Config: transformers.Qwen2ForCausalLM,
    transformers.Qwen3Config: transformers.Qwen3ForCausalLM,
}


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny(request, tmp_path_factory):
    config_cls, kwargs = CASES[request.param]
    hf, path = save_tiny_decoder(request.param, config_cls, ARCH[config_cls], kwargs, tmp_path_factory)
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24, block_size=4)
    return request.param, hf, llm


def _our_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """All-position logits of one prompt through pagedllm's model and the runner's attention backend."""
    runner = llm.llm_engine.core.executor.runner
    n = len(ids)
    num_blocks = -(-n // runner.block_size)
    table = np.arange(num_blocks, dtype=np.int64)[None, :]
    dev = runner.device
    layout = BatchLayout(np.array([0, n]), np.array([n]), table, torch.arange(n, device=dev), runner.block_size, dev)
    with torch.inference_mode(), forward_context(runner.backend.build_metadata(layout)):
        hidden = runner.model(torch.tensor(ids, device=dev), torch.arange(n, device=dev))
        return runner.model.compute_logits(hidden).cpu()


def test_logits_close(tiny):
    name, hf, llm = tiny
    ids = list(range(3, 40))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    ours = _our_logits(llm, ids)
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


def test_greedy_equal_in_one_batch(tiny):
    name, hf, llm = tiny
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 320, (int(n),), generator=gen).tolist() for n in (1, 5, 17, 30, 9, 2)]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        use_tqdm=False,
    )
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=24,
                do_sample=False,
                pad_token_id=0,
            )
        assert out.outputs[0].token_ids == ref[0, len(p) :].tolist(), f"{name}: prompt {p}"
