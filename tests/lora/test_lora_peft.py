"""LoRA end to end against PEFT: adapters made with the peft package on tiny random Llama and Qwen2 models; the
oracle is PEFT's merged model in HF transformers (greedy float32 tokens identical, logprobs close)."""

from __future__ import annotations

import functools
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from tiny_models import hf_greedy

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.forward_context import forward_context
from pagedllm.lora.mapping import StaticLoRAMapping

PROMPTS = [[5, 17, 42, 7, 99, 3], [11, 200, 13, 8], list(range(40, 61))]  # the last spans more than one KV block
MAX_TOKENS = 6
SP = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="session")
def lora_llm(lora_family):
    """max_loras=2 slots and max_cpu_loras=2 host copies for 4 adapters: a mixed batch queues adapters and reads
    evicted ones again from their folders."""
    _, base_path, _, _ = lora_family
    return LLM(
        base_path, dtype="float32", device="cpu", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22,
        enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2, max_num_seqs=8,
    )  # fmt: skip


def lora_requests(lora_family) -> dict[str, LoRARequest]:
    _, _, _, adapters = lora_family
    return {name: LoRARequest(name, i + 1, path) for i, (name, (path, _)) in enumerate(adapters.items())}


@functools.cache
def _oracle(key, model, prompt: tuple) -> tuple[list[int], list[float]]:
    return hf_greedy(model, list(prompt), MAX_TOKENS)


def oracle(lora_family, name: str | None, prompt: list[int]):
    arch, _, hf, adapters = lora_family
    model = hf if name is None else adapters[name][1]
    return _oracle((arch, name), model, tuple(prompt))


def tokens_and_logprobs(out):
    comp = out.outputs[0]
    return comp.token_ids, [lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids)]


def test_each_adapter_matches_peft_merged_model(lora_family, lora_llm):
    reqs = lora_requests(lora_family)
    for name, req in reqs.items():
        outs = lora_llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SP, use_tqdm=False, lora_request=req)
        for prompt, out in zip(PROMPTS, outs):
            tokens, logprobs = tokens_and_logprobs(out)
            ref_tokens, ref_logprobs = oracle(lora_family, name, prompt)
            assert tokens == ref_tokens, (name, prompt)
            assert logprobs == pytest.approx(ref_logprobs, abs=1e-4), (name, prompt)
    base_ref = oracle(lora_family, None, PROMPTS[0])[0]
    assert any(oracle(lora_family, name, PROMPTS[0])[0] != base_ref for name in reqs), "adapters change outputs"


def test_mixed_batch_gives_each_row_what_it_gives_alone(lora_family, lora_llm):
    """4 adapters and base rows in one generate call with 2 slots: rows queue for a slot, never fail."""
    reqs = lora_requests(lora_family)
    rows = [(name, PROMPTS[i % len(PROMPTS)]) for i, name in enumerate([*reqs, None, *reqs, None])]
    outs = lora_llm.generate(
        [{"prompt_token_ids": p} for _, p in rows],
        SP,
        use_tqdm=False,
        lora_request=[None if name is None else reqs[name] for name, _ in rows],
    )
    for (name, prompt), out in zip(rows, outs):
        assert out.outputs[0].token_ids == oracle(lora_family, name, prompt)[0], (name, prompt)
        assert out.lora_request is out.outputs[0].lora_request is (None if name is None else reqs[name])  # vLLM's


def test_adapters_never_share_prefix_cache_blocks(lora_family, lora_llm):
    reqs = list(lora_requests(lora_family).values())
    prompt = [{"prompt_token_ids": list(range(100, 137))}]  # two full blocks of 16 and more
    lora_llm.reset_prefix_cache()
    first = lora_llm.generate(prompt, SP, use_tqdm=False, lora_request=reqs[0])[0]
    other = lora_llm.generate(prompt, SP, use_tqdm=False, lora_request=reqs[1])[0]
    base = lora_llm.generate(prompt, SP, use_tqdm=False)[0]
    again = lora_llm.generate(prompt, SP, use_tqdm=False, lora_request=reqs[0])[0]
    assert (first.num_cached_tokens, other.num_cached_tokens, base.num_cached_tokens) == (0, 0, 0)
    assert again.num_cached_tokens == 32
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.outputs[0].token_ids == oracle(lora_family, reqs[1].lora_name, prompt[0]["prompt_token_ids"])[0]


def test_lora_requests_info_metric(lora_family, lora_llm):
    """vLLM's gauge: the running and waiting adapters by name, and max_lora."""
    reqs = list(lora_requests(lora_family).values())
    engine = lora_llm.llm_engine
    for i, lora in enumerate(reqs[:3]):
        engine.add_request(f"m{i}", [1, 2, 3], SP, lora_request=lora)  # vLLM's LLMEngine keyword
    engine.step()
    info = next(m for m in lora_llm.get_metrics() if m.name == "vllm:lora_requests_info")
    assert info.labels == {
        "max_lora": "2",
        "running_lora_adapters": ",".join(sorted(r.lora_name for r in reqs[:2])),
        "waiting_lora_adapters": reqs[2].lora_name,
    }
    while engine.has_unfinished_requests():
        engine.step()


# -- the CUDA-graph path: a static mapping over fixed buffers, no host sync --------------------------------------
HOST_SYNCS = [(torch.Tensor, n) for n in ("item", "tolist", "nonzero", "numpy", "cpu", "__bool__", "__int__")]
HOST_SYNCS.append((torch, "nonzero"))


@contextmanager
def no_host_syncs():
    """Tensor-to-host reads raise inside (what a CUDA-graph capture forbids)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a host sync in the graphed LoRA path")

    saved = [(owner, name, getattr(owner, name)) for owner, name in HOST_SYNCS]
    for owner, name, _ in saved:
        setattr(owner, name, refuse)
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def graph_mapping(manager, max_tokens: int = 256):
    """manager.mapping as the graphs' replay gets it: the step's slots loaded into a StaticLoRAMapping."""
    static = StaticLoRAMapping(max_tokens, manager.config.max_loras, manager.device)

    def mapping(token_lora_ids: np.ndarray):
        static.load(manager.token_slots(token_lora_ids), len(token_lora_ids))
        return static.view(len(token_lora_ids))

    return mapping


def test_graph_path_has_no_host_sync_and_equals_eager(lora_family, lora_llm):
    """Every LoRA layer over a mix of two adapters and base rows: the static mapping's forward reads nothing back
    to the host and gives the eager mapping's outputs (a test that a host sync would fail: see no_host_syncs)."""
    runner = lora_llm.llm_engine.core.executor.runner
    reqs = list(lora_requests(lora_family).values())  # [0]: every module, [2]: o, gate and down only
    for req in (reqs[0], reqs[2]):
        lora_llm.llm_engine.add_lora(req)
    ids = np.array([reqs[0].lora_int_id, 0, reqs[2].lora_int_id, reqs[0].lora_int_id, 0], dtype=np.int64)
    eager, static = runner.lora.mapping(ids), graph_mapping(runner.lora)(ids)
    g = torch.Generator().manual_seed(0)
    for name, weights in runner.lora.lora_model.layers.items():
        layer = runner.model.get_submodule(name)
        x = torch.randn(len(ids), weights.full_input, generator=g)
        with forward_context(object(), None):
            base = layer(x)
        with forward_context(object(), eager):
            expected = layer(x)
        with forward_context(object(), static), no_host_syncs():
            got = layer(x)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[[1, 4]], base[[1, 4]], atol=1e-6, rtol=0)  # base rows: no term
        assert (got[[0, 3]] - base[[0, 3]]).abs().max() > 1e-3, name  # adapter "all" targets every layer


def test_graph_path_matches_peft(lora_family, lora_llm, monkeypatch):
    """A mixed batch of 4 adapters and base rows with every step's LoRA term through the graphs' static mapping."""
    manager = lora_llm.llm_engine.core.executor.runner.lora
    monkeypatch.setattr(manager, "mapping", graph_mapping(manager))
    reqs = lora_requests(lora_family)
    rows = [(name, PROMPTS[i % len(PROMPTS)]) for i, name in enumerate([*reqs, None])]
    outs = lora_llm.generate(
        [{"prompt_token_ids": p} for _, p in rows],
        SP,
        use_tqdm=False,
        lora_request=[None if name is None else reqs[name] for name, _ in rows],
    )
    for (name, prompt), out in zip(rows, outs):
        tokens, logprobs = tokens_and_logprobs(out)
        ref_tokens, ref_logprobs = oracle(lora_family, name, prompt)
        assert tokens == ref_tokens, (name, prompt)
        assert logprobs == pytest.approx(ref_logprobs, abs=1e-4), (name, prompt)


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)], ids=str)
def test_parallel_ranks_match_one_rank_and_peft(lora_family, lora_llm, parallel, tmp_path):
    """Over two CPU processes (gloo). TP=2: B cut by output rows in column-parallel layers (q/k/v, gate/up), A by
    input features in row-parallel ones (o, down). PP=2: each stage loads its own layers' parts; an adapter whose
    module does not fit a layer of the second stage is refused when it is added (the driver holds the first stage),
    and the engine keeps serving. The same tokens as PEFT and the logprobs of one rank."""
    _, base_path, _, adapters = lora_family
    reqs = lora_requests(lora_family)
    rows = [(name, PROMPTS[i % len(PROMPTS)]) for i, name in enumerate([*reqs, None])]
    prompts = [{"prompt_token_ids": p} for _, p in rows]
    loras = [None if name is None else reqs[name] for name, _ in rows]
    one = lora_llm.generate(prompts, SP, use_tqdm=False, lora_request=loras)
    llm = LLM(
        base_path, dtype="float32", device="cpu", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22,
        enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2, max_num_seqs=8, **parallel,
    )  # fmt: skip
    try:
        if "pipeline_parallel_size" in parallel:
            bad = LoRARequest("bad", 99, _last_layer_widened(adapters["all"][0], tmp_path / "bad"))
            with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.q_proj.*another base model"):
                llm.generate(prompts[:1], SP, use_tqdm=False, lora_request=bad)
        two = llm.generate(prompts, SP, use_tqdm=False, lora_request=loras)
    finally:
        llm.llm_engine.shutdown()
    for (name, prompt), a, b in zip(rows, one, two):
        assert tokens_and_logprobs(b)[0] == oracle(lora_family, name, prompt)[0], (name, prompt)
        assert tokens_and_logprobs(b)[1] == pytest.approx(tokens_and_logprobs(a)[1], abs=1e-4), (name, prompt)


def _last_layer_widened(path: str, out) -> str:
    """A copy of the adapter at `path` whose last layer's q_proj A takes twice the base model's input features."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(path, out)
    tensors = load_file(str(out / "adapter_model.safetensors"))
    key = next(k for k in tensors if "layers.1.self_attn.q_proj.lora_A" in k)
    tensors[key] = torch.cat([tensors[key], tensors[key]], dim=1)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return str(out)
