"""LoRA in pooling models (a decoder run as an embedder): each prompt's embedding with its adapter equals the
embedding of PEFT's merged model loaded as a plain checkpoint, in a mixed call of adapters and base rows."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, LoRARequest

PROMPTS = [[5, 17, 42, 7, 99, 3], [11, 200, 13, 8], list(range(40, 61))]


def embedder(path: str, **kwargs) -> LLM:
    return LLM(path, convert="embed", dtype="float32", device="cpu", skip_tokenizer_init=True, **kwargs)


def embed(llm: LLM, prompts, lora_request=None) -> list[torch.Tensor]:
    items = [{"prompt_token_ids": p} for p in prompts]
    return [o.outputs.embedding for o in llm.embed(items, use_tqdm=False, lora_request=lora_request)]


def test_embeddings_with_adapters_match_merged_models(lora_family, tmp_path):
    _, base_path, hf, adapters = lora_family
    names = ["all", "qv-rslora"]
    expected = {None: embed(embedder(base_path), PROMPTS)}
    for name in names:
        merged_path = tmp_path / name
        adapters[name][1].save_pretrained(merged_path)
        expected[name] = embed(embedder(str(merged_path)), PROMPTS)
    assert not torch.allclose(torch.tensor(expected["all"][0]), torch.tensor(expected[None][0]), atol=1e-3)
    llm = embedder(base_path, enable_lora=True, max_loras=1, max_lora_rank=8)
    reqs = {name: LoRARequest(name, i + 1, adapters[name][0]) for i, name in enumerate(names)}
    rows = [(name, i) for name in [*names, None] for i in range(len(PROMPTS))]
    got = embed(llm, [PROMPTS[i] for _, i in rows], [None if n is None else reqs[n] for n, _ in rows])
    for (name, i), vector in zip(rows, got):
        torch.testing.assert_close(torch.tensor(vector), torch.tensor(expected[name][i]), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="max_lora_rank=8"):
        embed(llm, PROMPTS[:1], LoRARequest("big", 9, adapters["mlp-r16"][0]))


def test_adapters_over_two_ranks_equal_one_rank(lora_family):
    """Llama over two tensor-parallel ranks, Qwen2 over two pipeline stages: the other rank reads each adapter when
    a batch first brings it; every embedding equals one rank's (adapters and base rows mixed, two batches)."""
    arch, base_path, _, adapters = lora_family
    layout = {"tensor_parallel_size": 2} if arch == "llama" else {"pipeline_parallel_size": 2}
    reqs = [LoRARequest(name, i + 1, adapters[name][0]) for i, name in enumerate(["all", "qv-rslora"])]
    loras = [reqs[0], None, reqs[1], reqs[0]]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(loras))]
    options = dict(enable_lora=True, max_loras=2, max_lora_rank=8, max_num_batched_tokens=32)
    one = embed(embedder(base_path, **options), prompts, loras)
    llm = embedder(base_path, **options, **layout)
    got = embed(llm, prompts, loras)
    for vector, ref in zip(got, one):
        torch.testing.assert_close(torch.tensor(vector), torch.tensor(ref), atol=1e-5, rtol=1e-5)
    llm.llm_engine.shutdown()
