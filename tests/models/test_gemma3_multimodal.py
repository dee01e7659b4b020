"""A Gemma 3 image-text checkpoint (Gemma3ForConditionalGeneration) with text prompts: its language model against
HF's text-only generate, its vision weights loaded; an image on a checkpoint saved without a processor is a clear
error (tests/multimodal/test_gemma3.py runs images)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from tiny_models import TINY_DECODER
from tiny_models import hf_greedy as _hf_greedy

from pagedllm import LLM, SamplingParams

TEXT = dict(
    TINY_DECODER,
    head_dim=16,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention"],
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0},
    },
)
VISION = dict(
    hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
)


@pytest.fixture(scope="module")
def gemma3_mm(tmp_path_factory):
    torch.manual_seed(3)
    config = transformers.Gemma3Config(
        text_config=transformers.Gemma3TextConfig(**TEXT),
        vision_config=transformers.SiglipVisionConfig(**VISION),
        mm_tokens_per_image=4,
    )
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # norm weights start at 0 (Gemma's 1 + w): randomize them so that they matter
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    hf.generation_config.eos_token_id = None
    path = tmp_path_factory.mktemp("gemma3-mm")
    hf.save_pretrained(path)
    llm = LLM(
        str(path),
        dtype="float32",
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=1 << 22,
        block_size=4,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
    )
    return hf, llm


def test_checkpoint_vision_weights_are_loaded(gemma3_mm) -> None:
    hf, llm = gemma3_mm
    model = llm.llm_engine.core.executor.runner.model
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    qkv = model.vision_tower.encoder.layers[0].self_attn.qkv_proj  # the checkpoint's q, k, v in one matmul
    theirs = [getattr(hf.model.vision_tower.encoder.layers[0].self_attn, f"{p}_proj") for p in "qkv"]
    x = torch.randn(3, theirs[0].in_features)
    expected = torch.cat([proj(x) for proj in theirs], dim=-1)
    with torch.no_grad():
        torch.testing.assert_close(qkv(x), expected, atol=1e-5, rtol=1e-5)
    projector = hf.model.multi_modal_projector.mm_input_projection_weight
    torch.testing.assert_close(model.multi_modal_projector.mm_input_projection_weight, projector)
    assert llm.llm_engine.config.model.hf_config.num_hidden_layers == 2


def test_greedy_and_logprobs_match_hf_text_only(gemma3_mm) -> None:
    hf, llm = gemma3_mm
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 320, (int(n),), generator=gen).tolist() for n in (1, 6, 19, 30)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_logprobs = _hf_greedy(hf, prompt, 12)
        got = out.outputs[0]
        assert got.token_ids == ref_tokens, prompt
        ours = [step[t].logprob for step, t in zip(got.logprobs, got.token_ids)]
        np.testing.assert_allclose(ours, ref_logprobs, atol=1e-4, rtol=0, err_msg=str(prompt))


def test_image_without_a_saved_processor_is_an_error(gemma3_mm) -> None:
    _, llm = gemma3_mm
    image = np.zeros((28, 28, 3), dtype=np.uint8)
    prompt = {"prompt": "<start_of_image>", "multi_modal_data": {"image": image}}
    with pytest.raises(ValueError, match=r"multi_modal_data: the model folder has no usable processor for images"):
        llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 2  # the engine still serves


def test_bidirectional_text_model_is_refused() -> None:
    """EmbeddingGemma's all-bidirectional attention is not the causal decoder pagedllm runs: refused, not wrong."""
    from pagedllm.models.gemma3 import Gemma3ForCausalLM

    config = transformers.Gemma3TextConfig(**TEXT, use_bidirectional_attention=True)
    with pytest.raises(ValueError, match=r"use_bidirectional_attention=True \(EmbeddingGemma\) is not supported"):
        Gemma3ForCausalLM(config, max_position=64)
