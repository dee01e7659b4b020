"""A tiny Qwen3 (per-head q/k norm, GQA, head_dim 24) and a tiny Llama served on the Triton attention backend
(interpreted on CPU): the rotary goes through the fused rotary + KV write (the plain write never runs), decode
split-K through the attention kernel's last programs (splits forced at these short lengths), and greedy tokens and
logprobs stay HF's."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from tiny_models import TINY_DECODER, save_tiny_decoder

from pagedllm import LLM, SamplingParams
from pagedllm.attention import triton_backend

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter runs without a GPU only")

PROMPTS = [list(range(3, 40)), [7, 11, 13, 17, 19]]
MAX_TOKENS = 6
MODELS = {
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, dict(TINY_DECODER, head_dim=24)),
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, dict(TINY_DECODER)),
}


def hf_greedy(hf, tokens: list[int]) -> tuple[list[int], list[float]]:
    tokens, out, lps = list(tokens), [], []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logp = hf(torch.tensor([tokens])).logits[0, -1].double().log_softmax(-1)
            out.append(int(logp.argmax()))
            lps.append(float(logp.max()))
            tokens.append(out[-1])
    return out, lps


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fused_rotary_and_split_merge_keep_hf_outputs(name, tmp_path_factory, monkeypatch):
    config_cls, model_cls, kwargs = MODELS[name]
    hf, path = save_tiny_decoder(f"fused-{name}", config_cls, model_cls, kwargs, tmp_path_factory)
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, block_size=4, kv_cache_memory_bytes=1 << 22)
    runner = llm.llm_engine.core.executor.runner
    runner.backend = triton_backend
    runner.allocate_kv_cache(llm.llm_engine.config.cache.num_blocks)  # in the Triton layout, layers bound to it
    monkeypatch.setattr(triton_backend, "MIN_TOKENS_PER_SPLIT", 4)  # decodes over 8+ keys split
    monkeypatch.setattr(triton_backend, "reduce_splits_kernel", None)  # the last programs merge
    monkeypatch.setattr(triton_backend, "write_kv", None)  # every layer writes through rotary_write_kv
    counters = []
    split_counters = triton_backend.split_counters
    monkeypatch.setattr(triton_backend, "split_counters", lambda *a: counters.append(a) or split_counters(*a))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert counters, "decode steps split"
    for prompt, out in zip(PROMPTS, outs):
        ref_tokens, ref_lps = hf_greedy(hf, prompt)
        comp = out.outputs[0]
        assert list(comp.token_ids) == ref_tokens
        lps = [entry[tok].logprob for entry, tok in zip(comp.logprobs, comp.token_ids)]
        assert lps == pytest.approx(ref_lps, abs=1e-4)
