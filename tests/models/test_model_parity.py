"""Tiny random-weight models of each architecture against HF transformers in float32: all-position logits, and
greedy tokens with their logprobs through the engine (chunked prefill, prefix caching). One row of CASES per
architecture variant; a new architecture adds rows here."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from tiny_models import (
    TINY_BLOOM,
    TINY_DECODER,
    TINY_FALCON,
    TINY_GPT2,
    TINY_MHA,
    TINY_MLA,
    TINY_OPT,
    as_internlm2_checkpoint,
    save_tiny_decoder,
)
from tiny_models import (
    hf_greedy as _hf_greedy,
)
from tiny_models import (
    our_logits as _our_logits,
)

from pagedllm import LLM, SamplingParams

T = transformers
# vLLM's fixed dynamic-NTK base for theta 10000, head_dim 16, factor 2: theta * (f * f - (f - 1)) ** (d / (d - 2))
DYNAMIC_NTK_BASE = 10000.0 * (2.0 * 2.0 - 1.0) ** (16 / 14)


def as_dynamic_ntk_checkpoint(path: str) -> None:
    """The checkpoint's config for pagedllm: theta 10000 with dynamic NTK (factor 2) instead of HF's plain rope at
    DYNAMIC_NTK_BASE; HF's own dynamic NTK changes its base with each forward's length (test_rope_keywords.py)."""
    import json
    import os

    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.pop("rope_theta", None)
    config["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


# name -> (HF config class, HF model class, config kwargs[, rewrite of the saved checkpoint for pagedllm])
CASES = {
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, dict(TINY_DECODER)),
    "llama3-rope-tied": (
        T.LlamaConfig,
        T.LlamaForCausalLM,
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
    "mistral-sliding": (T.MistralConfig, T.MistralForCausalLM, dict(TINY_DECODER, sliding_window=8, head_dim=32)),
    "qwen2-bias": (T.Qwen2Config, T.Qwen2ForCausalLM, dict(TINY_DECODER, num_key_value_heads=1)),
    "qwen3-qknorm": (T.Qwen3Config, T.Qwen3ForCausalLM, dict(TINY_DECODER, head_dim=24)),
    "opt": (T.OPTConfig, T.OPTForCausalLM, dict(TINY_OPT)),
    "opt-proj-postnorm": (
        T.OPTConfig,
        T.OPTForCausalLM,
        dict(TINY_OPT, word_embed_proj_dim=48, do_layer_norm_before=False, tie_word_embeddings=False),
    ),
    "gpt2": (T.GPT2Config, T.GPT2LMHeadModel, dict(TINY_GPT2)),
    "gpt2-inverse-layer-scale": (
        T.GPT2Config,
        T.GPT2LMHeadModel,
        dict(TINY_GPT2, scale_attn_by_inverse_layer_idx=True, tie_word_embeddings=False, activation_function="gelu"),
    ),
    "gpt-neox-partial-rotary": (T.GPTNeoXConfig, T.GPTNeoXForCausalLM, dict(TINY_MHA, rotary_pct=0.25)),
    "gpt-neox-sequential": (
        T.GPTNeoXConfig,
        T.GPTNeoXForCausalLM,
        dict(TINY_MHA, rotary_pct=0.5, use_parallel_residual=False, tie_word_embeddings=True),
    ),
    "gemma": (T.GemmaConfig, T.GemmaForCausalLM, dict(TINY_DECODER, head_dim=32)),
    "gemma2-softcap-sliding": (
        T.Gemma2Config,
        T.Gemma2ForCausalLM,
        dict(
            TINY_DECODER,
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=1.5,  # small caps, so that capping changes the results
            final_logit_softcapping=2.0,
        ),
    ),
    "gemma3-text": (
        T.Gemma3TextConfig,
        T.Gemma3ForCausalLM,
        dict(
            TINY_DECODER,
            head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0},
            },
        ),
    ),
    "phi3-partial-rotary": (
        T.Phi3Config,
        T.Phi3ForCausalLM,
        dict(TINY_DECODER, partial_rotary_factor=0.5, pad_token_id=0, eos_token_id=1),
    ),
    "phi": (T.PhiConfig, T.PhiForCausalLM, dict(TINY_DECODER, partial_rotary_factor=0.5)),
    "phi-qk-layernorm": (T.PhiConfig, T.PhiForCausalLM, dict(TINY_MHA, partial_rotary_factor=0.25, qk_layernorm=True)),
    "starcoder2": (T.Starcoder2Config, T.Starcoder2ForCausalLM, dict(TINY_DECODER, use_bias=True, sliding_window=8)),
    "olmo-clip": (T.OlmoConfig, T.OlmoForCausalLM, dict(TINY_DECODER, clip_qkv=0.5, pad_token_id=0)),
    "olmo2": (T.Olmo2Config, T.Olmo2ForCausalLM, dict(TINY_DECODER, pad_token_id=0)),
    "granite": (
        T.GraniteConfig,
        T.GraniteForCausalLM,
        dict(
            TINY_DECODER,
            embedding_multiplier=3.0,
            attention_multiplier=0.3,
            residual_multiplier=0.5,
            logits_scaling=2.0,
        ),
    ),
    "gpt-bigcode-mqa": (T.GPTBigCodeConfig, T.GPTBigCodeForCausalLM, dict(TINY_GPT2)),
    "gpt-bigcode-mha": (T.GPTBigCodeConfig, T.GPTBigCodeForCausalLM, dict(TINY_GPT2, multi_query=False)),
    "gptj": (T.GPTJConfig, T.GPTJForCausalLM, dict(TINY_GPT2, rotary_dim=8, bos_token_id=1, eos_token_id=1)),
    "cohere-qk-norm": (
        T.CohereConfig,
        T.CohereForCausalLM,
        dict(TINY_DECODER, use_qk_norm=True, logit_scale=0.5, pad_token_id=0, bos_token_id=1, eos_token_id=1),
    ),
    "bloom-alibi": (T.BloomConfig, T.BloomForCausalLM, dict(TINY_BLOOM)),
    "bloom-residual-post-norm": (
        T.BloomConfig,
        T.BloomForCausalLM,
        dict(TINY_BLOOM, n_head=6, hidden_size=96, apply_residual_connection_post_layernorm=True),
    ),
    "mpt-alibi-clip": (
        T.MptConfig,
        T.MptForCausalLM,
        dict(d_model=64, n_heads=4, n_layers=2, vocab_size=320, max_seq_len=256, attn_config={"clip_qkv": 0.5}),
    ),
    "falcon-mqa-parallel": (T.FalconConfig, T.FalconForCausalLM, dict(TINY_FALCON)),
    "falcon-new-arch-gqa": (
        T.FalconConfig,
        T.FalconForCausalLM,
        dict(TINY_FALCON, new_decoder_architecture=True, num_kv_heads=2, bias=True),
    ),
    "falcon-alibi-sequential": (
        T.FalconConfig,
        T.FalconForCausalLM,
        dict(TINY_FALCON, alibi=True, multi_query=False, parallel_attn=False, bias=True),
    ),
    "phi3-longrope": (  # positions stay under original_max_position_embeddings: the short factors, scaled cos/sin
        T.Phi3Config,
        T.Phi3ForCausalLM,
        dict(
            TINY_DECODER,
            pad_token_id=0,
            eos_token_id=1,
            original_max_position_embeddings=64,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0 + 0.25 * i for i in range(8)],
                "long_factor": [2.0 + i for i in range(8)],
            },
        ),
    ),
    "llama-linear-rope": (
        T.LlamaConfig,
        T.LlamaForCausalLM,
        dict(TINY_DECODER, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    ),
    "qwen2-yarn": (
        T.Qwen2Config,
        T.Qwen2ForCausalLM,
        dict(
            TINY_DECODER,
            max_position_embeddings=64,
            rope_theta=1000.0,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        ),
    ),
    "llama-yarn-deepseek-mscale": (  # DeepSeek's mscale / mscale_all_dim ratio scales cos/sin; betas, no truncation
        T.LlamaConfig,
        T.LlamaForCausalLM,
        dict(
            TINY_DECODER,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 32,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
                "beta_fast": 8,
                "beta_slow": 2,
                "truncate": False,
            },
        ),
    ),
    # HF's plain rope at vLLM's fixed dynamic-NTK base; pagedllm reads the same model as dynamic NTK
    "llama-dynamic-ntk": (
        T.LlamaConfig,
        T.LlamaForCausalLM,
        dict(TINY_DECODER, rope_theta=DYNAMIC_NTK_BASE),
        as_dynamic_ntk_checkpoint,
    ),
    "mixtral-8-experts": (  # 8 experts, top-2: the random router sends tokens to the experts unevenly
        T.MixtralConfig,
        T.MixtralForCausalLM,
        dict(TINY_DECODER, num_local_experts=8, num_experts_per_tok=2),
    ),
    "qwen2-moe-shared-dense-layer": (  # layer 1 dense (mlp_only_layers), 6 experts top-2 unnormalized + shared
        T.Qwen2MoeConfig,
        T.Qwen2MoeForCausalLM,
        dict(
            TINY_DECODER,
            num_hidden_layers=3,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
        ),
    ),
    "qwen3-moe-sparse-step": (  # decoder_sparse_step=2: layer 0 dense, layer 1 has 8 experts top-3 normalized
        T.Qwen3MoeConfig,
        T.Qwen3MoeForCausalLM,
        dict(
            TINY_DECODER,
            head_dim=24,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=2,
        ),
    ),
    "olmoe-clip": (
        T.OlmoeConfig,
        T.OlmoeForCausalLM,
        dict(TINY_DECODER, num_experts=8, num_experts_per_tok=2, clip_qkv=0.5, pad_token_id=0),
    ),
    "deepseek-v2-dense": (T.DeepseekV2Config, T.DeepseekV2ForCausalLM, dict(TINY_MLA, first_k_dense_replace=2)),
    "deepseek-v2-qlora-grouped-moe": (  # layer 1: 8 experts in 4 groups (best 2), 2 shared; v_head_dim padded
        T.DeepseekV2Config,
        T.DeepseekV2ForCausalLM,
        dict(
            TINY_MLA,
            q_lora_rank=48,
            v_head_dim=24,
            n_shared_experts=2,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
        ),
    ),
    "deepseek-v2-yarn": (
        T.DeepseekV2Config,
        T.DeepseekV2ForCausalLM,
        dict(
            TINY_MLA,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "mscale": 0.707,
                "mscale_all_dim": 1.0,
                "beta_fast": 32,
                "beta_slow": 1,
            },
        ),
    ),
    "deepseek-v3-noaux-tc": (  # sigmoid scores, groups by top-2 sum, renormalized, x2.5
        T.DeepseekV3Config,
        T.DeepseekV3ForCausalLM,
        dict(TINY_MLA, q_lora_rank=48, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5),
    ),
    "deepseek-v3-rope-not-interleaved": (
        T.DeepseekV3Config,
        T.DeepseekV3ForCausalLM,
        dict(TINY_MLA, rope_interleave=False, n_group=1, topk_group=1, v_head_dim=40),
    ),
    # transformers has no InternLM2: HF's Llama on the same weights, saved in InternLM2's layout for pagedllm
    "internlm2": (T.LlamaConfig, T.LlamaForCausalLM, dict(TINY_DECODER), as_internlm2_checkpoint),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny(request, tmp_path_factory):
    config_cls, model_cls, kwargs, *rewrite = CASES[request.param]
    hf, path = save_tiny_decoder(request.param, config_cls, model_cls, kwargs, tmp_path_factory)
    for fn in rewrite:
        fn(path)
    llm = LLM(
        path,
        dtype="float32",
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=1 << 24,
        block_size=4,
        max_num_batched_tokens=16,  # prompts run in chunks; decodes share steps with prefill chunks
        enable_prefix_caching=True,
    )
    return request.param, hf, llm


def test_logits_close(tiny):
    name, hf, llm = tiny
    ids = list(range(3, 40))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    ours = _our_logits(llm, ids)
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


def test_greedy_and_logprobs_equal(tiny):
    """Greedy tokens identical to HF's and their logprobs within 1e-4, for a batch of six prompts run in chunks of
    16 tokens, then one prompt that extends a finished one (its prefix blocks come from the prefix cache)."""
    name, hf, llm = tiny
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 320, (int(n),), generator=gen).tolist() for n in (1, 5, 17, 30, 9, 2)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    for batch in (prompts, [prompts[3] + [7, 11, 13]]):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        if len(batch) == 1:  # the 7 full blocks of prompts[3] came from the cache
            assert outs[0].num_cached_tokens >= 28, outs[0].num_cached_tokens
        for p, out in zip(batch, outs):
            ref_tokens, ref_logprobs = _hf_greedy(hf, p, 16)
            got = out.outputs[0]
            assert got.token_ids == ref_tokens, f"{name}: prompt {p}"
            ours = [step[t].logprob for step, t in zip(got.logprobs, got.token_ids)]
            np.testing.assert_allclose(ours, ref_logprobs, atol=1e-4, rtol=0, err_msg=f"{name}: prompt {p}")
