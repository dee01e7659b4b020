"""LoRA requests speculate: with n-gram drafts, and with a draft model that knows nothing of their adapters (the
target, with the request's adapter, verifies every draft, so the outputs stay exact). The draft model here is one
adapter's PEFT-merged model: that adapter's requests have their drafts accepted, the other adapter's mostly
rejected. The oracle is PEFT's merged model in HF transformers (greedy float32 tokens identical); the spec-decode
metrics of a batch of LoRA requests alone show drafts proposed and accepted for them."""

from __future__ import annotations

import pytest
from tiny_models import hf_greedy

from pagedllm import LLM, LoRARequest, SamplingParams

PROMPTS = [[5, 17, 33, 101, 7] * 6, [11, 12] * 12, list(range(40, 61))]
MAX_TOKENS = 24
ADAPTERS = ["all", "qv-rslora"]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_lora_requests_speculate_and_match_peft(lora_family, method, tmp_path):
    _, base_path, hf_base, adapters = lora_family
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        spec |= {"prompt_lookup_max": 3, "prompt_lookup_min": 1}
    else:
        adapters[ADAPTERS[0]][1].save_pretrained(tmp_path)  # the first adapter merged into the base
        spec |= {"model": str(tmp_path)}
    llm = LLM(
        base_path, dtype="float32", device="cpu", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22,
        block_size=4, enable_lora=True, max_loras=2, max_lora_rank=16, speculative_config=spec,
    )  # fmt: skip
    reqs = [LoRARequest(name, i + 1, adapters[name][0]) for i, name in enumerate(ADAPTERS)]
    rows = [(req, prompt) for req in reqs for prompt in PROMPTS]  # LoRA requests only: the metrics are theirs
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    sched = llm.llm_engine.core.scheduler
    outs = llm.generate(
        [{"prompt_token_ids": p} for _, p in rows], sp, use_tqdm=False, lora_request=[r for r, _ in rows]
    )
    for (req, prompt), out in zip(rows, outs):
        expected = hf_greedy(adapters[req.lora_name][1], prompt, MAX_TOKENS)[0]
        assert out.outputs[0].token_ids == expected, (req.lora_name, prompt)
    assert sched.num_draft_tokens > 0 and sched.num_accepted_tokens > 0, (
        sched.num_draft_tokens,
        sched.num_accepted_tokens,
    )
    assert any(hf_greedy(hf_base, p, MAX_TOKENS)[0] != o.outputs[0].token_ids for p, o in zip(PROMPTS, outs))
