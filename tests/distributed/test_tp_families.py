"""Tensor and pipeline parallelism across the model families: each family that supports it, split over two CPU
processes (gloo, float32; TP=2 or PP=2), gives HF transformers' greedy tokens, with logprobs within 1e-4, through
chunked prefill and the prefix cache (the same check as tests/models/test_model_parity.py on one rank). Families
without support refuse it with a clear error."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from models.test_model_parity import CASES
from tiny_models import hf_greedy, save_tiny_decoder

from pagedllm import LLM, SamplingParams
from pagedllm.engine_args import EngineArgs
from pagedllm.layers.build_context import BuildContext
from pagedllm.model_loader.loader import get_model
from pagedllm.models.registry import get_model_class

# the quick tier's cases (the rest run in the slow tier): OPT's with its projections in and out
QUICK = {("llama", "tp"), ("qwen2-bias", "tp"), ("llama3-rope-tied", "pp"), ("opt-proj-postnorm", "pp")}
# the Llama-like families' stages share one forward (LlamaModel's): a few whose layers differ most stand for the rest
PP_FAMILIES = {
    "llama3-rope-tied",
    "gemma2-softcap-sliding",
    "gemma3-text",  # (a rope table per layer type: each stage's layers take theirs)
    "olmo2",
    "mixtral-8-experts",
    "deepseek-v3-noaux-tc",
    "phi3-longrope",
}
# the families with a forward of their own, one case each (GPTBigCode's stages are GPT-2's: its model subclasses it):
# learned positions on the first stage, tied heads, ALiBi, parallel blocks that send (stream, zeros), OPT's
# projections in and out (project_out on the last stage: a narrower final hidden state goes back)
PP_FAMILIES |= {
    "gpt2",
    "gptj",
    "gpt-neox-sequential",
    "opt-proj-postnorm",
    "phi",
    "bloom-alibi",
    "falcon-mqa-parallel",
    "mpt-alibi-clip",
}
FLAGS = {"tp": "supports_tensor_parallel", "pp": "supports_pipeline_parallel"}
# variants of another case's family that differ only in their RoPE scaling: the rotation runs on each rank's own
# heads with the same tables, so splitting them adds nothing to the single-rank parity test of each variant
ROPE_VARIANTS = {
    "llama-dynamic-ntk",
    "llama-linear-rope",
    "llama-yarn-deepseek-mscale",
    "deepseek-v2-yarn",
    "qwen2-yarn",
    "phi3-partial-rotary",
}


def _cases() -> list:
    cases = []
    for name in sorted(set(CASES) - ROPE_VARIANTS):
        arch = CASES[name][1].__name__
        if name == "internlm2":
            arch = "InternLM2ForCausalLM"
        try:
            cls = get_model_class(arch, "pagedllm")
        except (KeyError, ValueError):
            continue
        for kind, flag in FLAGS.items():
            if getattr(cls, flag, False) and (kind == "tp" or name in PP_FAMILIES):
                marks = () if (name, kind) in QUICK else pytest.mark.slow
                cases.append(pytest.param(name, kind, marks=marks, id=f"{name}-{kind}2"))
    return cases


def tp_llm(path: str, tp: int = 2, pp: int = 1, **kwargs) -> LLM:
    base = dict(dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22, block_size=4)
    return LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, **{**base, **kwargs})


@pytest.mark.parametrize("name, kind", _cases())
def test_two_ranks_greedy_matches_hf(name, kind, tmp_path_factory):
    config_cls, model_cls, kwargs, *rewrite = CASES[name]
    hf, path = save_tiny_decoder(name, config_cls, model_cls, kwargs, tmp_path_factory)
    for fn in rewrite:
        fn(path)
    tp, pp = (2, 1) if kind == "tp" else (1, 2)
    llm = tp_llm(path, tp, pp, max_num_batched_tokens=16, enable_prefix_caching=True)
    try:
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, 320, (int(n),), generator=gen).tolist() for n in (1, 17, 30, 9)]
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
        for batch in (prompts, [prompts[2] + [7, 11, 13]]):
            outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
            if len(batch) == 1:
                assert outs[0].num_cached_tokens >= 28, outs[0].num_cached_tokens
            for p, out in zip(batch, outs):
                ref_tokens, ref_logprobs = hf_greedy(hf, p, 12)
                got = out.outputs[0]
                assert got.token_ids == ref_tokens, f"{name}: prompt {p}"
                ours = [step[t].logprob for step, t in zip(got.logprobs, got.token_ids)]
                np.testing.assert_allclose(ours, ref_logprobs, atol=1e-4, rtol=0, err_msg=f"{name}: prompt {p}")
    finally:
        llm.llm_engine.shutdown()


def test_unsupported_family_is_refused(tmp_path_factory, monkeypatch):
    """A model class without supports_tensor_parallel (every decoder family here has it: one is switched off) is
    refused by the loader, naming the architecture; so is one without supports_pipeline_parallel (the transformers
    fallback has neither)."""
    config_cls, model_cls, kwargs = CASES["gpt2"]
    _, path = save_tiny_decoder("gpt2-tp", config_cls, model_cls, kwargs, tmp_path_factory)
    monkeypatch.setattr(get_model_class("GPT2LMHeadModel", "pagedllm"), "supports_tensor_parallel", False)
    config = EngineArgs(model=path, device="cpu", dtype="float32", skip_tokenizer_init=True).create_engine_config()
    with pytest.raises(ValueError, match="GPT2LMHeadModel does not support tensor parallelism"):
        get_model(config.model, torch.device("cpu"), BuildContext(tp_rank=0, tp_size=2))
    with pytest.raises(ValueError, match="GPT2LMHeadModel does not support pipeline parallelism"):
        tp_llm(path, 1, 2, model_impl="transformers")
