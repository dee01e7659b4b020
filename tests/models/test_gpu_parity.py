"""Every architecture of test_model_parity.CASES on CUDA in bfloat16 (CUDA graphs, chunked prefill, prefix caching)
against HF transformers on CUDA in bfloat16. Skipped without CUDA.

bf16 rule: two bf16 runs may pick different tokens where the top two logits nearly tie, and after a different token
the sequences are unrelated. So greedy tokens must be identical up to the first step where HF's top-2 logits are
closer than TIE_MARGIN * max(1, |top1|); over that identical prefix (the tie step included, if the tokens still
agree there) each chosen token's logprob must be within LOGPROB_ATOL of HF's. Steps after the first near-tie are not
compared."""

from __future__ import annotations

import gc

import pytest
import torch
from test_model_parity import CASES
from tiny_models import save_tiny_decoder

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu

TIE_MARGIN = 0.05  # relative bf16 noise margin on HF's top-2 logit gap
LOGPROB_ATOL = 5e-2
MAX_TOKENS = 12
PROMPT_LENS = (1, 5, 17, 30, 9, 2)
BATCH_SIZES = (1, 6)


def hf_greedy_steps(hf, prompt: list[int], max_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """HF's greedy tokens and each step's logits [vocab] (float32 copies), on the model's device."""
    dev = next(hf.parameters()).device
    ids = torch.tensor([prompt], device=dev)
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
            return_dict_in_generate=True,
            output_logits=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), [step[0].float().cpu() for step in out.logits]


def compare_greedy(
    ours: list[int],
    our_logprobs: list[float],
    ref: list[int],
    ref_logits: list[torch.Tensor],
    tie_margin: float = TIE_MARGIN,
    logprob_atol: float = LOGPROB_ATOL,
) -> int:
    """Asserts the bf16 rule of this module; returns how many steps were compared."""
    assert len(ours) == len(ref) == len(our_logprobs) == len(ref_logits), (len(ours), len(ref))
    for i, (tok, logits) in enumerate(zip(ours, ref_logits)):
        top2 = torch.topk(logits, 2).values
        near_tie = (top2[0] - top2[1]).item() < tie_margin * max(1.0, abs(top2[0].item()))
        if tok != ref[i]:
            assert near_tie, f"step {i}: token {tok} != HF's {ref[i]}, top-2 gap {(top2[0] - top2[1]).item():.4f}"
            return i
        ref_lp = torch.log_softmax(logits, -1)[tok].item()
        assert abs(our_logprobs[i] - ref_lp) <= logprob_atol, f"step {i}: logprob {our_logprobs[i]} vs HF's {ref_lp}"
        if near_tie:  # later steps may follow a different continuation
            return i + 1
    return len(ours)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 320, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def run_case(name: str, hf, llm: LLM) -> int:
    """Both batch sizes through llm, each output held to compare_greedy; returns the steps compared."""
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    compared = 0
    for size in BATCH_SIZES:
        batch = prompts[:size]
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        for p, out in zip(batch, outs):
            got = out.outputs[0]
            lps = [step[t].logprob for step, t in zip(got.logprobs, got.token_ids)]
            ref, ref_logits = hf_greedy_steps(hf, p, MAX_TOKENS)
            try:
                compared += compare_greedy(got.token_ids, lps, ref, ref_logits)
            except AssertionError as e:
                raise AssertionError(f"{name}, batch {size}, prompt {p}: {e}") from e
    return compared


@pytest.mark.parametrize("name", sorted(CASES))
def test_bf16_greedy_matches_hf(name, tmp_path_factory):
    config_cls, model_cls, kwargs, *rewrite = CASES[name]
    hf, path = save_tiny_decoder(name, config_cls, model_cls, kwargs, tmp_path_factory)
    for fn in rewrite:
        fn(path)
    hf = hf.to("cuda", torch.bfloat16)
    llm = LLM(
        path,
        dtype="bfloat16",
        device="cuda",
        enforce_eager=False,
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=1 << 24,
        block_size=4,
        max_num_seqs=16,
        max_num_batched_tokens=16,  # prompts run in chunks; decodes share steps with prefill chunks
        enable_prefix_caching=True,
    )
    try:
        compared = run_case(name, hf, llm)
        assert compared > 0, f"{name}: every output began at a near-tie; nothing compared"
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()
