"""The transformers fallback (model_impl="transformers") against HF transformers: tiny random-weight checkpoints,
fp32 greedy tokens identical and logprobs within 1e-4 through the engine (chunked prefill, prefix caching); the
routing of model_impl and its errors."""

from __future__ import annotations

import argparse
import gc
import os

import numpy as np
import pytest
import torch
import transformers
from test_model_parity import CASES as PARITY_CASES
from test_model_parity import _hf_greedy, _our_logits
from tiny_models import TINY_DECODER, save_tiny_decoder

from pagedllm import LLM, SamplingParams
from pagedllm.engine_args import EngineArgs
from pagedllm.entrypoints.openai.cli_args import add_serve_parser
from pagedllm.models.registry import native_architectures, resolve_model_impl
from pagedllm.models.transformers_fallback import TransformersForCausalLM

T = transformers
# name -> (HF config class, HF model class, config kwargs, model_impl asked for)
CASES = {
    # a native architecture forced through the fallback
    "llama-forced": (T.LlamaConfig, T.LlamaForCausalLM, dict(TINY_DECODER), "transformers"),
    # scaling from query_pre_attn_scalar, a sliding window, attention and final logit soft-caps, tied head
    "gemma2-forced": (
        T.Gemma2Config,
        T.Gemma2ForCausalLM,
        dict(
            TINY_DECODER,
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=1.5,
            final_logit_softcapping=2.0,
        ),
        "transformers",
    ),
    # no native class: "auto" takes the fallback
    "helium-auto": (T.HeliumConfig, T.HeliumForCausalLM, dict(TINY_DECODER, head_dim=16), "auto"),
}
ENGINE = dict(
    skip_tokenizer_init=True,
    kv_cache_memory_bytes=1 << 24,
    block_size=4,
    max_num_batched_tokens=16,  # prompts run in chunks; decodes share steps with prefill chunks
    enable_prefix_caching=True,
)


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny(request, tmp_path_factory):
    config_cls, model_cls, kwargs, impl = CASES[request.param]
    hf, path = save_tiny_decoder(request.param, config_cls, model_cls, kwargs, tmp_path_factory)
    llm = LLM(path, dtype="float32", model_impl=impl, **ENGINE)
    yield request.param, hf, llm
    del llm
    gc.collect()


def test_runs_the_fallback(tiny):
    name, _, llm = tiny
    assert llm.llm_engine.config.model.model_impl == "transformers"
    runner = llm.llm_engine.core.executor.runner
    assert isinstance(runner.model, TransformersForCausalLM)
    assert len(runner.attn_layers) == 2 and all(layer.kv_cache is not None for layer in runner.attn_layers)


def test_load_weights_names(tiny):
    """A checkpoint saved without the base-model prefix loads into the same parameters; an unknown name is refused."""
    name, hf, llm = tiny
    model = llm.llm_engine.core.executor.runner.model
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    expected = {n for n, _ in model.named_parameters()}
    base = [(k.removeprefix("model."), torch.zeros_like(v) if "layernorm" in k else v) for k, v in state.items()]
    assert model.load_weights(base) == expected
    layernorm = next(p for n, p in model.named_parameters() if "layernorm" in n)
    assert not layernorm.any()  # the unprefixed name reached the prefixed parameter
    assert model.load_weights(state.items()) == expected  # put back
    with pytest.raises(ValueError, match=r"'model.layers.0.extra.weight' has no parameter"):
        model.load_weights([("model.layers.0.extra.weight", torch.zeros(2))])


def test_greedy_and_logprobs_equal_hf(tiny):
    """Batches of 6, 3 and 1 prompts (1 to 30 tokens, in chunks of at most 16 tokens a step), then a prompt that
    extends a finished one: its prefix blocks come from the prefix cache."""
    name, hf, llm = tiny
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 320, (int(n),), generator=gen).tolist() for n in (1, 5, 17, 30, 9, 2)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    for batch in (prompts, prompts[1:4], [prompts[3] + [7, 11, 13]]):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        if len(batch) == 1:  # the 7 full blocks of prompts[3] came from the cache
            assert outs[0].num_cached_tokens >= 28, outs[0].num_cached_tokens
        for p, out in zip(batch, outs):
            ref_tokens, ref_logprobs = _hf_greedy(hf, p, 12)
            got = out.outputs[0]
            assert got.token_ids == ref_tokens, f"{name}: prompt {p}"
            ours = [step[t].logprob for step, t in zip(got.logprobs, got.token_ids)]
            np.testing.assert_allclose(ours, ref_logprobs, atol=1e-4, rtol=0, err_msg=f"{name}: prompt {p}")


@pytest.mark.parametrize("name", sorted(PARITY_CASES))
def test_every_parity_case_forced_through_the_fallback(name, tmp_path_factory):
    """Each native architecture's test_model_parity case with model_impl="transformers": all-position logits and a
    chunked prompt's greedy tokens equal HF's, or, for a model with its own attention code, the refusal (what the
    README's Path column says)."""
    config_cls, model_cls, kwargs, *rewrite = PARITY_CASES[name]
    if rewrite:
        pytest.skip("a checkpoint rewritten for an architecture transformers does not ship")
    hf, path = save_tiny_decoder(name, config_cls, model_cls, kwargs, tmp_path_factory)
    if not model_cls._supports_attention_backend:
        with pytest.raises(ValueError, match="custom attention code"):
            LLM(path, model_impl="transformers", **ENGINE)
        return
    if any(
        getattr(hf.config, f, None) for f in ("kv_lora_rank", "num_local_experts", "num_experts", "n_routed_experts")
    ):
        with pytest.raises(ValueError, match="does not run (MLA attention|mixture-of-experts)"):
            LLM(path, model_impl="transformers", **ENGINE)
        return
    llm = LLM(path, dtype="float32", model_impl="transformers", **ENGINE)
    ids = list(range(3, 40))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(_our_logits(llm, ids), ref, atol=2e-4, rtol=1e-4)
    prompt = ids[:21]  # two chunks of at most 16 tokens
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == _hf_greedy(hf, prompt, 4)[0]


def _save_config(path, config) -> str:
    os.makedirs(path, exist_ok=True)
    config.save_pretrained(path)
    return str(path)


def test_custom_attention_is_refused_naming_the_architecture(tmp_path):
    """GPT-Neo (no native class) and Bloom (native, forced) compute attention in their own code."""
    neo = T.GPTNeoConfig(hidden_size=64, num_layers=2, num_heads=4, vocab_size=320, attention_types=[[["global"], 2]])
    neo.architectures = ["GPTNeoForCausalLM"]
    path = _save_config(tmp_path / "neo", neo)
    for impl in ("auto", "transformers"):
        with pytest.raises(ValueError, match=r"'GPTNeoForCausalLM'.*custom attention code"):
            LLM(path, model_impl=impl, **ENGINE)
    with pytest.raises(ValueError, match=r"'BloomForCausalLM'.*custom attention code"):
        resolve_model_impl("BloomForCausalLM", "transformers")
    assert resolve_model_impl("BloomForCausalLM", "auto") == "pagedllm"


def test_bidirectional_attention_is_refused(monkeypatch):
    """An attention module that is not causal (an encoder's) cannot run on the causal paged cache."""
    attention_cls = T.models.llama.modeling_llama.LlamaAttention
    init = attention_cls.__init__

    def bidirectional_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.is_causal = False

    monkeypatch.setattr(attention_cls, "__init__", bidirectional_init)
    config = T.LlamaConfig(**TINY_DECODER)
    config.architectures = ["LlamaForCausalLM"]
    with pytest.raises(ValueError, match=r"'LlamaForCausalLM'.*causal"):
        TransformersForCausalLM(config, max_position=64)


def test_unknown_architecture_error_names_model_impl(tmp_path):
    config = T.LlamaConfig(**TINY_DECODER)
    config.architectures = ["FooForCausalLM"]
    path = _save_config(tmp_path / "foo", config)
    with pytest.raises(ValueError) as err:
        LLM(path, **ENGINE)
    message = str(err.value)
    assert "'FooForCausalLM' is not supported" in message and 'model_impl="transformers"' in message
    with pytest.raises(ValueError, match=r"'FooForCausalLM'.*not among them"):
        resolve_model_impl("FooForCausalLM", "transformers")


def test_model_impl_routing():
    assert resolve_model_impl("LlamaForCausalLM") == "pagedllm"
    assert resolve_model_impl("LlamaForCausalLM", "vllm") == "pagedllm"  # vLLM's name of the native path
    assert resolve_model_impl("LlamaForCausalLM", "transformers") == "transformers"
    assert resolve_model_impl("HeliumForCausalLM") == "transformers"
    assert "HeliumForCausalLM" not in native_architectures()
    with pytest.raises(ValueError, match=r"'HeliumForCausalLM' is not supported"):
        resolve_model_impl("HeliumForCausalLM", "pagedllm")
    with pytest.raises(ValueError, match=r"model_impl='native' must be one of"):
        resolve_model_impl("LlamaForCausalLM", "native")


def test_serve_flag_and_pooling_refusal(tmp_path):
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "m", "--model-impl", "transformers"])
    assert args.model_impl == "transformers" and EngineArgs.cli_kwargs(args)["model_impl"] == "transformers"
    bert = T.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37)
    bert.architectures = ["BertModel"]
    with pytest.raises(ValueError, match=r"'BertModel'.*not among them"):  # no causal LM: refused before loading
        LLM(_save_config(tmp_path / "bert", bert), model_impl="transformers", **ENGINE)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_bf16_greedy_matches_hf_on_gpu(name, tmp_path_factory):
    """On CUDA in bf16 against HF in bf16, with test_gpu_parity's near-tie rule. The fallback runs eagerly: CUDA
    graphs stay off for it even with enforce_eager=False."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from test_gpu_parity import run_case

    config_cls, model_cls, kwargs, impl = CASES[name]
    hf, path = save_tiny_decoder(name, config_cls, model_cls, kwargs, tmp_path_factory)
    hf = hf.to("cuda", torch.bfloat16)
    llm = LLM(path, dtype="bfloat16", device="cuda", enforce_eager=False, max_num_seqs=16, model_impl=impl, **ENGINE)
    try:
        assert llm.llm_engine.core.executor.runner.graphs is None
        assert run_case(name, hf, llm) > 0, f"{name}: every output began at a near-tie; nothing compared"
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def test_bundled_gguf_through_the_fallback(smollm2):
    """The bundled GGUF (a generic config, GGUF weight names mapped to HF's) gives the native class's greedy tokens."""
    params = SamplingParams(temperature=0, max_tokens=12)
    tokens = {}
    for impl in ("transformers", "pagedllm"):
        llm = LLM(smollm2, model_impl=impl, max_model_len=256, dtype="float32")
        assert llm.llm_engine.config.model.model_impl == impl
        tokens[impl] = llm.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0].token_ids
        del llm
        gc.collect()
    assert tokens["transformers"] == tokens["pagedllm"]


def test_moe_or_mla_fields_in_a_checkpoints_own_config_are_refused():
    """The layout check reads the checkpoint's config too, not only the class's defaults (DBRX: ffn_config)."""
    from pagedllm.models.transformers_fallback import check_layout

    check_layout("LlamaForCausalLM", transformers.LlamaConfig())
    with pytest.raises(ValueError, match="does not run mixture-of-experts"):
        check_layout("DbrxForCausalLM", transformers.DbrxConfig())
    config = transformers.LlamaConfig()
    config.num_experts = 4
    with pytest.raises(ValueError, match=r"'LlamaForCausalLM'.*num_experts in the config"):
        check_layout("LlamaForCausalLM", config)
