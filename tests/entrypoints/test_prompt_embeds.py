"""Prompts given as input embeddings (enable_prompt_embeds, {"prompt_embeds": tensor}) on a tiny random Llama in
float32: the greedy tokens and logprobs of a token prompt and of HF's generate from inputs_embeds, in a batch mixed
with token prompts, with chunked prefill, preemption and prefix caching (no hit between embeddings and tokens)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from tiny_models import TINY_DECODER, save_tiny_decoder

from pagedllm import LLM, EmbedsPrompt, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
PROMPTS = [[(7 * i + 3 * j) % 250 + 1 for i in range(n)] for j, n in enumerate((37, 20, 50))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_decoder("llama-embeds", transformers.LlamaConfig, transformers.LlamaForCausalLM, TINY_DECODER,
                             tmp_path_factory)  # fmt: skip


def embeds_of(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf.get_input_embeddings()(torch.tensor(ids))  # [seq_len, hidden]


def make_llm(path: str, **kwargs) -> LLM:
    args = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=128, enable_prompt_embeds=True,
                kv_cache_memory_bytes=1 << 22)  # fmt: skip
    return LLM(path, **{**args, **kwargs})


def tokens_and_logprobs(out):
    c = out.outputs[0]
    return c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]


def hf_from_embeds(hf, embeds: torch.Tensor, max_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(inputs_embeds=embeds[None], attention_mask=torch.ones(1, len(embeds), dtype=torch.long),
                          max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)  # fmt: skip
    return out[0, -max_tokens:].tolist()


@pytest.mark.parametrize("budget", [256, 16])  # 16: every prompt is prefilled in chunks across steps
def test_embeddings_give_the_tokens_and_logprobs_of_the_token_prompt(tiny, budget):
    hf, path = tiny
    llm = make_llm(path, max_num_batched_tokens=budget, max_num_seqs=8)
    mixed: list = []
    for ids in PROMPTS:  # each prompt twice: as embeddings and as tokens, in one batch
        mixed += [EmbedsPrompt(prompt_embeds=embeds_of(hf, ids)), {"prompt_token_ids": ids}]
    outs = llm.generate(mixed, GREEDY, use_tqdm=False)
    for i, ids in enumerate(PROMPTS):
        from_embeds, from_ids = outs[2 * i], outs[2 * i + 1]
        tokens, logprobs = tokens_and_logprobs(from_embeds)
        ref_tokens, ref_logprobs = tokens_and_logprobs(from_ids)
        assert tokens == ref_tokens
        assert logprobs == pytest.approx(ref_logprobs, abs=1e-4)
        assert from_embeds.prompt_token_ids is None and from_ids.prompt_token_ids == ids  # as vLLM's
    assert outs[0].outputs[0].token_ids == hf_from_embeds(hf, embeds_of(hf, PROMPTS[0]), 8)


def test_preempted_embeddings_prompt_is_recomputed_from_its_embeddings(tiny):
    hf, path = tiny
    # 8 blocks of 16: the two requests cannot both reach 50 + 40 tokens, one is preempted and recomputed
    llm = make_llm(path, num_gpu_blocks_override=8, kv_cache_memory_bytes=None, max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": PROMPTS[0]}, EmbedsPrompt(prompt_embeds=embeds_of(hf, PROMPTS[2]))]
    outs = llm.generate(prompts, params, use_tqdm=False)  # the newest (the embeddings) is preempted first
    assert llm.llm_engine.core.scheduler.num_preemptions > 0
    ref = llm.generate([{"prompt_token_ids": PROMPTS[2]}], params, use_tqdm=False)[0]
    assert outs[1].outputs[0].token_ids == ref.outputs[0].token_ids
    assert not llm.llm_engine.core.executor.runner.batch.prompt_embeds  # rows drop them once their prompt is done


def test_prompt_logprobs_and_penalties_see_the_placeholder_ids(tiny):
    """As vLLM's: the prompt positions hold token id 0, which prompt_logprobs score and repetition_penalty counts."""
    hf, path = tiny
    llm = make_llm(path)
    ids = PROMPTS[1]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    embeds, zeros = llm.generate([EmbedsPrompt(prompt_embeds=embeds_of(hf, ids)), [0] * len(ids)], params,
                                 use_tqdm=False)  # fmt: skip
    assert embeds.prompt_logprobs[0] is None and all(list(lp) == [0] for lp in embeds.prompt_logprobs[1:])
    # token 0 made the greedy choice by a bias; a repetition penalty undoes it only where 0 is in the prompt
    biased = SamplingParams(max_tokens=1, temperature=0.0, logit_bias={0: 50.0}, repetition_penalty=1e4)
    outs = llm.generate([EmbedsPrompt(prompt_embeds=embeds_of(hf, ids)), ids], biased, use_tqdm=False)
    assert outs[0].outputs[0].token_ids != [0] and outs[1].outputs[0].token_ids == [0]  # (ids holds no 0)


def test_prefix_cache_never_matches_embeddings_against_tokens(tiny):
    hf, path = tiny
    llm = make_llm(path)  # prefix caching is on by default
    ids = PROMPTS[2]  # 50 tokens: 3 full blocks
    placeholders = {"prompt_token_ids": [0] * len(ids)}  # the ids an embeddings prompt stands on
    embeds = EmbedsPrompt(prompt_embeds=embeds_of(hf, ids))
    first = llm.generate([embeds], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert llm.generate([placeholders], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    assert llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    other = EmbedsPrompt(prompt_embeds=embeds_of(hf, ids) + 0.01)  # other embeddings: no hit either
    assert llm.generate([other], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    again = llm.generate([embeds], GREEDY, use_tqdm=False)[0]  # the same embeddings: its full blocks hit
    assert again.num_cached_tokens == 48
    assert tokens_and_logprobs(again)[0] == tokens_and_logprobs(first)[0]
    salted = llm.generate([{**embeds, "cache_salt": "a"}], GREEDY, use_tqdm=False)[0]
    assert salted.num_cached_tokens == 0


def test_refusals(tiny, tmp_path_factory):
    hf, path = tiny
    good = embeds_of(hf, PROMPTS[1])
    off = LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=64,
              kv_cache_memory_bytes=1 << 22)  # fmt: skip
    with pytest.raises(ValueError, match=r"prompts\[0\]\.prompt_embeds: .*enable_prompt_embeds=True"):
        off.generate({"prompt_embeds": good}, use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt\.prompt_embeds: .*enable_prompt_embeds=True"):
        off.llm_engine.add_request("r", {"prompt_embeds": good}, GREEDY)
    llm = make_llm(path, max_model_len=32)
    cases = [
        ({"prompt_embeds": good, "prompt_token_ids": [1, 2]}, r"either prompt_embeds or prompt_token_ids"),
        ({"prompt_embeds": good[:, :10]}, r"shape \(20, 10\); expected \[seq_len, 64\]"),
        ({"prompt_embeds": good[None, None]}, r"expected \[seq_len, 64\]"),
        ({"prompt_embeds": good.to(torch.int64)}, r"dtype torch.int64"),
        ({"prompt_embeds": good[:0]}, r"empty"),
        ({"prompt_embeds": good.tolist()}, r"type list; expected a torch.Tensor"),
        ({"prompt_embeds": torch.cat([good, good])}, r"prompt length 40 is longer than max_model_len=32"),
    ]
    for prompt, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate(prompt, GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match=message):
            llm.llm_engine.add_request("r", prompt, GREEDY)
    beam = SamplingParams(use_beam_search=True, best_of=2, max_tokens=2, temperature=0.0)
    with pytest.raises(ValueError, match=r"beam search takes text or token prompts"):
        llm.generate({"prompt_embeds": good}, beam, use_tqdm=False)
    from pagedllm import BeamSearchParams

    with pytest.raises(ValueError, match=r"prompts\[0\]\.prompt_embeds: beam search"):
        llm.beam_search([{"prompt_embeds": good}], BeamSearchParams(beam_width=2, max_tokens=2))
    # the 3D form [1, seq_len, hidden] is taken as [seq_len, hidden], as vLLM does
    assert len(llm.generate({"prompt_embeds": good[None]}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 8
    opt_hf, opt = save_tiny_decoder("opt-embeds", transformers.OPTConfig, transformers.OPTForCausalLM,
                                    dict(hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
                                         vocab_size=320, word_embed_proj_dim=64), tmp_path_factory)  # fmt: skip
    with pytest.raises(ValueError, match=r"enable_prompt_embeds=True: OPTForCausalLM: its decoder takes no input"):
        make_llm(opt)


@pytest.mark.parametrize(
    "family",
    [
        ("gemma", transformers.GemmaConfig, transformers.GemmaForCausalLM, dict(TINY_DECODER, head_dim=32)),
        ("qwen2", transformers.Qwen2Config, transformers.Qwen2ForCausalLM, TINY_DECODER),
    ],
    ids=lambda f: f[0],
)
def test_other_decoders_match_hf_generate_from_inputs_embeds(family, tmp_path_factory):
    """Through the shared seam (LlamaModel.embed_inputs): HF's inputs_embeds as get_input_embeddings() gives them
    (Gemma's already scaled by sqrt(hidden) there) give the token prompt's tokens and logprobs."""
    name, config_cls, model_cls, kwargs = family
    hf, path = save_tiny_decoder(f"{name}-embeds", config_cls, model_cls, kwargs, tmp_path_factory)
    embeds = embeds_of(hf, PROMPTS[0])
    llm = make_llm(path)
    out = llm.generate(EmbedsPrompt(prompt_embeds=embeds), GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_from_embeds(hf, embeds, 8)
    tokens, logprobs = tokens_and_logprobs(out)
    ref_tokens, ref_logprobs = tokens_and_logprobs(llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY,
                                                                use_tqdm=False)[0])  # fmt: skip
    assert tokens == ref_tokens
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=1e-4, rtol=0)
