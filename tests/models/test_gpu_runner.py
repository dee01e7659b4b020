"""GPU model runner: greedy tokens of tiny random models against HF transformers on the GPU (float32) and against
the CPU path, with CUDA graphs on and off; bfloat16 logprobs against HF in bfloat16; a padded graph replay against
the eager forward; KV-cache sizing by profiling. Skipped without CUDA."""

from __future__ import annotations

import gc

import pytest
import torch
import transformers
from tiny_models import TINY_DECODER, save_tiny_decoder

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu

CASES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(TINY_DECODER)),
    "mistral-sliding": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(TINY_DECODER, sliding_window=8, head_dim=32),
    ),
    "qwen3-qknorm": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(TINY_DECODER, head_dim=24)),
}
PROMPT_LENS = (1, 5, 17, 30, 9, 2)  # six decodes per step: padded to the captured size 8
MAX_TOKENS = 24


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny(request, tmp_path_factory):
    config_cls, model_cls, kwargs = CASES[request.param]
    hf, path = save_tiny_decoder(request.param, config_cls, model_cls, kwargs, tmp_path_factory)
    return request.param, hf, path


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 320, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _llm(path: str, **kwargs) -> LLM:
    opts = dict(skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24, block_size=4, max_num_seqs=16)
    return LLM(path, **{**opts, **kwargs})


def _greedy(llm: LLM, prompts: list[list[int]], **params) -> list:
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **params)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def _hf_greedy(hf, prompts: list[list[int]], device: str) -> list[list[int]]:
    out = []
    for p in prompts:
        with torch.no_grad():
            ids = torch.tensor([p], device=device)
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False)
        out.append(ref[0, len(p) :].tolist())
    return out


def _runner(llm: LLM):
    return llm.llm_engine.core.executor.runner


def test_greedy_equal_hf_gpu_and_cpu(tiny):
    name, hf, path = tiny
    prompts = _prompts()
    ref = _hf_greedy(hf.to("cuda", torch.float32), prompts, "cuda")
    hf.to("cpu")
    cpu = [o.outputs[0].token_ids for o in _greedy(_llm(path, dtype="float32", device="cpu"), prompts)]
    for eager, async_scheduling in ((False, None), (True, None), (False, False)):
        llm = _llm(path, dtype="float32", enforce_eager=eager, async_scheduling=async_scheduling)
        assert llm.llm_engine.config.scheduler.async_scheduling is (async_scheduling is None)  # on by default
        outs = [o.outputs[0].token_ids for o in _greedy(llm, prompts)]
        graphs = _runner(llm).graphs
        if eager:
            assert graphs is None
        else:
            assert graphs.sizes == [1, 2, 4, 8, 16] and graphs.num_replays >= MAX_TOKENS - 1
        what = f"{name} eager={eager} async={async_scheduling}"
        assert outs == ref, f"{what}: GPU tokens differ from HF on the GPU"
        assert outs == cpu, f"{what}: GPU tokens differ from the CPU path"
        del llm
        gc.collect()


def test_async_scheduling_equals_sync_on_gpu(tiny):
    """Seeded sampling, penalties, logprobs and stop tokens under preemption (16 blocks of 4 tokens for six
    requests): async scheduling changes no token."""
    name, hf, path = tiny
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    cases = [
        SamplingParams(temperature=0.8, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=1.0, max_tokens=MAX_TOKENS),
        SamplingParams(temperature=0, stop_token_ids=[7, 11, 13, 17], max_tokens=MAX_TOKENS, min_tokens=3),
    ]
    results = {}
    for async_scheduling in (False, True):
        llm = _llm(path, dtype="float32", async_scheduling=async_scheduling, num_gpu_blocks_override=16)
        outs = [llm.generate(prompts, sp, use_tqdm=False) for sp in cases]
        results[async_scheduling] = [[(c.token_ids, c.finish_reason) for o in r for c in o.outputs] for r in outs]
        assert llm.llm_engine.core.scheduler.num_preemptions > 0
        del llm
        gc.collect()
    assert results[True] == results[False], f"{name}: async scheduling changed the tokens"


def test_sampler_state_kept_on_the_device_equals_uploads_every_step(tiny):
    """The sampling kernel's inputs kept on the device from step to step (advanced by the kernel; only the rows that
    join uploaded) against the same inputs uploaded whole every step (no state kept), in one batch of mixed
    requests (seeds, penalties, logprobs, filters) of different lengths, under async scheduling and preemption:
    the same tokens and logprobs."""
    name, hf, path = tiny
    prompts = [{"prompt_token_ids": p} for p in _prompts()] * 2
    params = [
        SamplingParams(temperature=0.8, seed=5, logprobs=2, top_k=20, max_tokens=MAX_TOKENS),
        SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=1.0, max_tokens=MAX_TOKENS - 7),
        SamplingParams(temperature=1.1, seed=9, frequency_penalty=0.8, top_p=0.9, logprobs=1, max_tokens=11),
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
        SamplingParams(temperature=0.7, seed=3, min_p=0.1, repetition_penalty=1.3, max_tokens=MAX_TOKENS - 3),
        SamplingParams(temperature=0, frequency_penalty=1.2, logprobs=3, max_tokens=5),
    ]
    params = params + [p.clone() for p in params]
    for i, p in enumerate(params):
        p.ignore_eos = True
        p.max_tokens = 9 if i >= 6 else p.max_tokens  # the second six leave early: the batch changes
    results = {}
    for kept in (True, False):
        llm = _llm(path, dtype="float32", num_gpu_blocks_override=24)
        runner = _runner(llm)
        assert runner.sampler.resident is not None
        if not kept:
            runner.sampler.resident = None  # SamplingMetadata.build: every input uploaded each step
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[kept] = [
            (c.token_ids, [sorted(lp.items()) for lp in c.logprobs or []]) for o in outs for c in o.outputs
        ]
        assert llm.llm_engine.core.scheduler.num_preemptions > 0
        del llm
        gc.collect()
    assert results[True] == results[False], f"{name}: the state kept on the device changed the tokens"


def test_bf16_logprobs_close_to_hf(tiny):
    name, hf, path = tiny
    prompts = _prompts()
    llm = _llm(path, dtype="bfloat16")
    outs = _greedy(llm, prompts, logprobs=0)
    hf_bf16 = hf.to("cuda", torch.bfloat16)
    diffs = []
    for p, o in zip(prompts, outs):
        ids = o.outputs[0].token_ids
        ours = torch.tensor([lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, ids)])
        with torch.no_grad():
            logits = hf_bf16(torch.tensor([p + ids[:-1]], device="cuda")).logits[0, len(p) - 1 :].float()
        theirs = logits.log_softmax(-1).gather(1, torch.tensor(ids, device="cuda")[:, None]).squeeze(1).cpu()
        diffs.append((ours - theirs).abs())
    hf.to("cpu", torch.float32)
    diff = torch.cat(diffs)
    assert diff.max() < 0.15 and diff.mean() < 0.03, f"{name}: max {diff.max():.4f}, mean {diff.mean():.4f}"


def test_padded_graph_replay_equals_eager(tiny):
    """Five decodes padded to the captured size 8: the replayed rows equal an eager forward of the same buffers."""
    name, hf, path = tiny
    llm = _llm(path, dtype="float32")
    runner = _runner(llm)
    g = runner.graphs
    torch.manual_seed(0)
    for layer in runner.attn_layers:
        layer.kv_cache.normal_()  # every slot the kernels may read holds a finite value
    ids, pos = torch.randint(0, 320, (5,)).numpy(), torch.tensor([3, 9, 1, 20, 7]).numpy()
    table = (torch.arange(5 * g.max_blocks).view(5, g.max_blocks) % 64).numpy()  # [5, max_blocks]
    slots = torch.full((5,), -1).numpy()  # no KV write: both runs read the same cache
    g.load_inputs(8, ids, pos, slots, pos + 1, table)
    with torch.inference_mode():
        replayed = g.replay(8, 5).clone()
        eager = g.forward_eager(8)[:5]
        g.load_inputs(8, ids, pos, slots, pos + 2, table)  # one more key each: the replay reads the new lengths
        longer = g.replay(8, 5).clone()
    assert torch.isfinite(replayed).all()
    torch.testing.assert_close(replayed, eager, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(longer, replayed)


def test_kv_cache_sized_by_profiling(tiny):
    name, hf, path = tiny
    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, gpu_memory_utilization=0.05, max_model_len=256)
    prof = _runner(llm).memory_profile
    assert prof is not None and prof["peak_activation_bytes"] > 0
    budget = int(0.05 * prof["total_bytes"])
    rest = prof["weights_bytes"] + prof["peak_activation_bytes"] + prof["outside_torch_bytes"]
    assert prof["kv_cache_bytes"] == budget - rest - prof["graph_reserve_bytes"]
    per_block = _runner(llm).kv_bytes_per_block()
    assert llm.llm_engine.core.config.cache.num_blocks == prof["kv_cache_bytes"] // per_block
    assert _greedy(llm, _prompts()[:2])[0].outputs[0].token_ids  # runs
    free, total = torch.cuda.mem_get_info()
    assert total - free <= budget + (64 << 20), "the engine uses more than gpu_memory_utilization of the GPU"
    del llm
    gc.collect()
    with pytest.raises(ValueError, match="does not fit.*gpu_memory_utilization"):
        LLM(path, dtype="float32", skip_tokenizer_init=True, gpu_memory_utilization=0.0001)
    overridden = LLM(path, skip_tokenizer_init=True, num_gpu_blocks_override=7, gpu_memory_utilization=0.0001)
    assert overridden.llm_engine.core.config.cache.num_blocks == 7
    assert _runner(overridden).memory_profile is None


def test_bf16_default_on_gpu(tiny):
    name, hf, path = tiny  # the saved config says float32: vLLM runs those in bfloat16 on a GPU
    llm = _llm(path)
    assert llm.llm_engine.core.config.model.dtype == torch.bfloat16


def test_logits_left_in_bf16_give_the_same_tokens(tiny, monkeypatch):
    """Greedy and plain-temperature steps keep the LM head's bfloat16 logits (no float32 copy); the argmax and the
    sampling kernel read them exactly, so forcing the float32 copy changes no token."""
    name, hf, path = tiny
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    params = [SamplingParams(temperature=t, seed=9, max_tokens=MAX_TOKENS, ignore_eos=True) for t in (0, 0.7, 1.3)]
    llm = _llm(path, dtype="bfloat16")
    runner = _runner(llm)
    dtypes = []
    compute_logits = runner.model.compute_logits
    monkeypatch.setattr(
        runner.model, "compute_logits", lambda h, upcast=True: dtypes.append(upcast) or compute_logits(h, upcast)
    )
    kept = [[c.token_ids for o in llm.generate(prompts, sp, use_tqdm=False) for c in o.outputs] for sp in params]
    assert dtypes and not any(dtypes), "the fast path kept no step in bfloat16"
    monkeypatch.setattr(runner.sampler, "needs_float32", lambda *a: True)
    upcast = [[c.token_ids for o in llm.generate(prompts, sp, use_tqdm=False) for c in o.outputs] for sp in params]
    assert any(dtypes[-1:]) and kept == upcast, f"{name}: bfloat16 logits changed the tokens"
