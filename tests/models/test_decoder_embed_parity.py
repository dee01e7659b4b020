"""Decoder models as embedders (task="embed"): last-token and mean pooling of the final hidden states against HF
transformers, on tiny random Llama / Qwen2 / Qwen3 / Mistral (sliding window) models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from tiny_models import TINY_DECODER, save_tiny_decoder

from pagedllm import LLM, PoolingParams

CASES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(TINY_DECODER)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(TINY_DECODER, num_key_value_heads=1)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(TINY_DECODER, head_dim=24)),
    "mistral-sliding": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(TINY_DECODER, sliding_window=8),
    ),
}
# token prompts of different lengths (longer than the sliding window), in one batch
PROMPTS = [[(7 * i + 3 * j) % 300 + 5 for j in range(n)] for i, n in enumerate([1, 5, 13, 30, 47, 9])]


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny_decoder(request, tmp_path_factory):
    config_cls, model_cls, kwargs = CASES[request.param]
    hf, path = save_tiny_decoder(request.param, config_cls, model_cls, kwargs, tmp_path_factory, random_norms=False)
    return path, hf


def _hf_states(hf, ids: list[int]) -> torch.Tensor:
    """[len, hidden] final (normed) hidden states of one prompt, run alone."""
    with torch.no_grad():
        return hf.model(torch.tensor([ids])).last_hidden_state[0]


def test_last_token_embedding_matches_hf(tiny_decoder):
    path, hf = tiny_decoder
    llm = LLM(path, task="embed", dtype="float32", skip_tokenizer_init=True)
    outs = llm.embed([{"prompt_token_ids": ids} for ids in PROMPTS], use_tqdm=False)
    for ids, out in zip(PROMPTS, outs):
        ref = F.normalize(_hf_states(hf, ids)[-1], dim=-1)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, atol=1e-5, rtol=1e-4)


def test_mean_pooling_matches_hf(tiny_decoder):
    path, hf = tiny_decoder
    llm = LLM(path, runner="pooling", convert="embed", dtype="float32", skip_tokenizer_init=True,
              pooler_config={"pooling_type": "MEAN", "normalize": False})  # fmt: skip
    outs = llm.embed([{"prompt_token_ids": ids} for ids in PROMPTS], use_tqdm=False)
    for ids, out in zip(PROMPTS, outs):
        ref = _hf_states(hf, ids).mean(0)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, atol=1e-5, rtol=1e-4)
    # normalize per request overrides the model default
    normed = llm.embed({"prompt_token_ids": PROMPTS[3]}, pooling_params=PoolingParams(normalize=True), use_tqdm=False)
    ref = F.normalize(_hf_states(hf, PROMPTS[3]).mean(0), dim=-1)
    torch.testing.assert_close(torch.tensor(normed[0].outputs.embedding), ref, atol=1e-5, rtol=1e-4)


def test_decoder_generates_by_default_and_refuses_embed(tiny_decoder):
    path, _ = tiny_decoder
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, num_gpu_blocks_override=16)
    with pytest.raises(ValueError, match=r"embed\(\): .* generative model .*task='embed'"):
        llm.embed({"prompt_token_ids": PROMPTS[1]}, use_tqdm=False)
    with pytest.raises(ValueError, match="task='classify'.* no classification head"):
        LLM(path, task="classify", skip_tokenizer_init=True)
