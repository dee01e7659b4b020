"""EAGLE and EAGLE-3 speculation on a tiny random Llama target with tiny random heads written in the EAGLE checkpoint
layouts (float32, CPU). The oracle for the proposer is a plain re-implementation of the heads here: each proposal
equals the greedy chain it computes from scratch (target features from HF transformers, causal attention over the
whole sequence). Outputs with speculation equal those without, token for token, with logprobs and seeded n > 1.

Random heads almost never agree with the target: to verify accepted drafts too, some tests force the drafts at even
positions to the target's greedy continuation (the proposer's force_drafts hook, as the benchmark does); the head
still runs its chain on them, and its own tokens at the other positions are checked against the oracle."""

from __future__ import annotations

import gc
import json
import os

import pytest
import torch
import transformers
from safetensors.torch import save_file
from tiny_models import TINY_DECODER, save_tiny_decoder

from pagedllm import LLM, SamplingParams

K = 3
PROMPTS = [[5, 17, 33, 101, 7] * 4, list(range(40, 62)), [9, 8, 7], [200, 201, 202, 150, 151, 200, 201]]
BATCHES = {"all": [0, 1, 2, 3], "short first": [2, 1]}
TARGET = dict(TINY_DECODER, num_hidden_layers=4)
AUX_LAYERS = [1, 2, 3]  # (vLLM's default (2, L // 2, L - 3) needs a deeper target)
DRAFT_VOCAB = 96
H, HEADS, KV_HEADS, HEAD_DIM, FFN, EPS = 64, 4, 2, 16, 96, 1e-6


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    hf, path = save_tiny_decoder(
        "eagle-target", transformers.LlamaConfig, transformers.LlamaForCausalLM, TARGET, tmp_path_factory
    )
    with torch.no_grad():
        hf.lm_head.weight.mul_(8)  # peaked next-token distributions: sampled tokens often follow the greedy path
    hf.save_pretrained(path)
    return hf, path


def _random(shape, scale=0.15):
    return torch.randn(shape) * scale


def save_head(path: str, eagle3: bool) -> dict[str, torch.Tensor]:
    """A random head in the EAGLE (layers.0.*, fc with bias, an embedding that is not used: the target's is) or
    EAGLE-3 (midlayer.*, fc over 3 hidden states, norm, lm_head over DRAFT_VOCAB tokens, d2t, t2d, its own embedding)
    checkpoint layout."""
    torch.manual_seed(3 if eagle3 else 1)
    layer = "midlayer" if eagle3 else "layers.0"
    qkv_in = 2 * H if eagle3 else H
    w = {
        f"{layer}.self_attn.q_proj.weight": _random((HEADS * HEAD_DIM, qkv_in)),
        f"{layer}.self_attn.k_proj.weight": _random((KV_HEADS * HEAD_DIM, qkv_in)),
        f"{layer}.self_attn.v_proj.weight": _random((KV_HEADS * HEAD_DIM, qkv_in)),
        f"{layer}.self_attn.o_proj.weight": _random((H, HEADS * HEAD_DIM)),
        f"{layer}.mlp.gate_proj.weight": _random((FFN, H)),
        f"{layer}.mlp.up_proj.weight": _random((FFN, H)),
        f"{layer}.mlp.down_proj.weight": _random((H, FFN)),
        f"{layer}.post_attention_layernorm.weight": 1 + _random(H, 0.1),
    }
    config = dict(TINY_DECODER, num_hidden_layers=1, architectures=["LlamaForCausalLM"], model_type="llama")
    if eagle3:
        target_ids = torch.sort(torch.randperm(TARGET["vocab_size"])[:DRAFT_VOCAB]).values
        w |= {
            f"{layer}.input_layernorm.weight": 1 + _random(H, 0.1),
            f"{layer}.hidden_norm.weight": 1 + _random(H, 0.1),
            "fc.weight": _random((H, 3 * H), 0.1),
            "norm.weight": 1 + _random(H, 0.1),
            "lm_head.weight": _random((DRAFT_VOCAB, H), 1.0),
            "d2t": target_ids - torch.arange(DRAFT_VOCAB),
            "t2d": torch.zeros(TARGET["vocab_size"], dtype=torch.bool).index_fill(0, target_ids, True),
            "embed_tokens.weight": _random((TARGET["vocab_size"], H), 1.0),  # its own (EAGLE-3 may have one)
        }
        config |= dict(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=DRAFT_VOCAB)
        config |= dict(eagle_aux_hidden_state_layer_ids=AUX_LAYERS)
    else:
        w |= {"fc.weight": _random((H, 2 * H), 0.1), "fc.bias": _random(H, 0.1)}
        w["embed_tokens.weight"] = torch.zeros(TARGET["vocab_size"], H)  # unused: the target's is shared
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in w.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return w


@pytest.fixture(scope="module", params=["eagle", "eagle3"])
def method(request):
    return request.param


@pytest.fixture(scope="module")
def engine(method, target, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(f"head-{method}"))
    weights = save_head(path, method == "eagle3")
    spec = {"method": method, "model": path, "num_speculative_tokens": K}
    llm = LLM(
        target[1], dtype="float32", skip_tokenizer_init=True, block_size=4, kv_cache_memory_bytes=1 << 22,
        speculative_config=spec,
    )  # fmt: skip
    return llm, weights


# -- the oracle: the heads in plain torch, over a whole sequence ------------------------------------------------------
def _rms(x, weight):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def _rotate(x, positions):  # x [n, heads, d]: Llama's rotary (theta 10000, halves rotated)
    inv = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    angles = positions[:, None].float() * inv[None]  # [n, d/2]
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _layer(w, p, x_attn_in, residual):
    n = x_attn_in.shape[0]
    pos = torch.arange(n)
    q = _rotate((x_attn_in @ w[p + "self_attn.q_proj.weight"].T).view(n, HEADS, HEAD_DIM), pos)
    k = _rotate((x_attn_in @ w[p + "self_attn.k_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM), pos)
    v = (x_attn_in @ w[p + "self_attn.v_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM**0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1) @ w[p + "self_attn.o_proj.weight"].T
    residual = attn + residual
    x = _rms(residual, w[p + "post_attention_layernorm.weight"])
    x = torch.nn.functional.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)
    return x @ w[p + "mlp.down_proj.weight"].T, residual


def head_forward(w, eagle3, embed, tokens, hidden):
    """Rows 0..n-1 at positions 0..n-1: (token ids [n], hidden [n, H]) -> (logit hidden, next hidden) [n, H]."""
    e = embed[tokens]
    if eagle3:
        normed = _rms(hidden, w["midlayer.hidden_norm.weight"])
        attn_in = torch.cat([_rms(e, w["midlayer.input_layernorm.weight"]), normed], -1)
        x, residual = _layer(w, "midlayer.", attn_in, hidden)
        out = x + residual
        return _rms(out, w["norm.weight"]), out
    x = torch.cat([e, hidden], -1) @ w["fc.weight"].T + w["fc.bias"]
    x, residual = _layer(w, "layers.0.", x, x)
    return x + residual, x + residual


def oracle_drafts(hf, w, eagle3, tokens: list[int], forced: list[int]) -> list[int]:
    """The K greedy drafts after `tokens`: target features at positions 0..T-2, each with the next token; then the
    chain, each step appending (draft, previous output hidden) and running the whole sequence again. forced [K]:
    where >= 0, the draft proposed and fed on instead of the head's."""
    with torch.no_grad():
        states = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        if eagle3:  # hidden_states[i]: the input of layer i
            features = torch.cat([states[i][0] for i in AUX_LAYERS], -1)[:-1] @ w["fc.weight"].T
        else:
            features = states[-1][0, :-1]  # the last hidden state (after the final norm)
        embed = w["embed_tokens.weight"] if eagle3 else hf.model.embed_tokens.weight
        head = w["lm_head.weight"] if eagle3 else hf.lm_head.weight
        ids, hidden, drafts = list(tokens[1:]), features, []
        for j in range(K):
            logit_h, next_h = head_forward(w, eagle3, embed, torch.tensor(ids), hidden)
            logits = logit_h[-1] @ head.T
            if eagle3:  # the draft vocabulary's logits placed at their target ids, as vLLM does
                logits = torch.full((TARGET["vocab_size"],), float("-inf")).index_copy(
                    0, torch.arange(DRAFT_VOCAB) + w["d2t"], logits
                )
            drafts.append(forced[j] if forced[j] >= 0 else int(logits.argmax()))
            ids.append(drafts[-1])
            hidden = torch.cat([hidden, next_h[-1:]])
        return drafts


class Forced:
    """force_drafts: the draft at an even position p is the reference's token there (at odd ones -1: the head's)."""

    def __init__(self, references: list[list[int]]) -> None:
        self.references = references

    def __call__(self, histories: list[list[int]]) -> list[list[int]]:
        return [self.drafts(tokens) for tokens in histories]

    def drafts(self, tokens: list[int]) -> list[int]:
        ref = next((r for r in self.references if r[: len(tokens)] == tokens), [])
        n = len(tokens)
        return [ref[p] if p < len(ref) and p % 2 == 0 else -1 for p in range(n, n + K)]


@pytest.fixture(scope="module")
def forced(engine) -> Forced:
    """The greedy continuations of PROMPTS without speculation."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs, _ = run(engine[0], PROMPTS, params, speculate=False)
    return Forced([o.prompt_token_ids + list(o.outputs[0].token_ids) for o in outputs])


def test_proposals_equal_the_oracle(engine, method, target, forced):
    llm, weights = engine
    drafter = llm.llm_engine.core.executor.runner.drafter
    calls = record_proposals(drafter)
    drafter.force_drafts = forced
    try:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        _, (num_drafts, num_accepted) = run(llm, PROMPTS[:3], params, speculate=True)
    finally:
        del drafter.propose
        drafter.force_drafts = None
    assert len(calls) >= 12 and num_accepted > 0  # after the prefill and after verifying steps that accepted some
    w = {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}
    for tokens, drafts in calls:
        assert drafts == oracle_drafts(target[0], w, method == "eagle3", tokens, forced.drafts(tokens)), tokens


def record_proposals(drafter) -> list:
    """(tokens so far, drafts) of each proposal the drafter makes from now on (del drafter.propose stops it)."""
    calls, propose = [], drafter.propose

    def recording(token_ids):
        out = propose(token_ids)
        calls.extend((list(token_ids[r]), out.tokens_of(r)) for r in out)  # (a DeviceDrafts)
        return out

    drafter.propose = recording
    return calls


def test_asynchronous_steps_feed_the_head(method, target, tmp_path):
    """With asynchronous scheduling (drafts off above disable_by_batch_size) the head consumes each step's hidden
    states one step late: once one request is left, its proposals equal the oracle's."""
    path = str(tmp_path / method)
    weights = save_head(path, method == "eagle3")
    spec = {"method": method, "model": path, "num_speculative_tokens": K, "disable_by_batch_size": 1}
    llm = LLM(
        target[1], dtype="float32", skip_tokenizer_init=True, block_size=4, kv_cache_memory_bytes=1 << 22,
        speculative_config=spec, async_scheduling=True,
    )  # fmt: skip
    drafter = llm.llm_engine.core.executor.runner.drafter
    calls = record_proposals(drafter)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (8, 16)]
    reference, _ = run(llm, PROMPTS[:2], params, speculate=False)
    outputs, (num_drafts, _) = run(llm, PROMPTS[:2], params, speculate=True)
    assert exact(outputs) == exact(reference) and num_drafts > 0
    assert calls and all(len(tokens) > len(PROMPTS[1]) + 8 for tokens, _ in calls)  # after the other one ended
    w = {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}
    for tokens, drafts in calls:
        assert drafts == oracle_drafts(target[0], w, method == "eagle3", tokens, [-1] * K), tokens


def test_preemption_chunked_prefill_and_prefix_hits(engine, target, forced, method, tmp_path):
    # 24 blocks of 4 tokens for 4 requests of up to 42 tokens: preemption; a 16-token budget: chunked prefill (the
    # head consumes prompts chunk by chunk); then the same prompts with their outputs: prefix-cache hits
    spec = {
        "method": method,
        "model": engine[0].llm_engine.config.speculative_config.model,
        "num_speculative_tokens": K,
    }
    small = LLM(
        target[1], dtype="float32", skip_tokenizer_init=True, block_size=4, num_gpu_blocks_override=24,
        max_num_batched_tokens=16, speculative_config=spec,
    )  # fmt: skip
    small.llm_engine.core.executor.runner.drafter.force_drafts = forced
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    reference, _ = run(small, PROMPTS, params, speculate=False)
    outputs, (num_drafts, num_accepted) = run(small, PROMPTS, params, speculate=True)
    assert exact(outputs) == exact(reference) and num_accepted > 0
    assert small.llm_engine.core.scheduler.num_preemptions > 0
    continued = [o.prompt_token_ids + list(o.outputs[0].token_ids)[:8] for o in reference]
    hits = small.llm_engine.core.scheduler.kv.num_hits
    reference, _ = run(small, continued[:2], params, speculate=False)
    outputs, _ = run(small, continued[:2], params, speculate=True)
    assert exact(outputs) == exact(reference) and small.llm_engine.core.scheduler.kv.num_hits > hits


def run(llm: LLM, prompts, params, speculate: bool):
    config, sched = llm.llm_engine.config, llm.llm_engine.core.scheduler
    proposer, before = config.speculative_proposer, (sched.num_draft_tokens, sched.num_accepted_tokens)
    if not speculate:
        config.speculative_proposer = None
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        config.speculative_proposer = proposer
    return outputs, (sched.num_draft_tokens - before[0], sched.num_accepted_tokens - before[1])


def exact(outputs) -> list:
    return [(c.token_ids, [sorted(d) for d in c.logprobs or []]) for o in outputs for c in o.outputs]


@pytest.mark.parametrize("batch", BATCHES)
def test_greedy_with_logprobs_equals_no_speculation(engine, forced, batch):
    llm, _ = engine
    prompts = [PROMPTS[i] for i in BATCHES[batch]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    reference, none = run(llm, prompts, params, speculate=False)
    drafter = llm.llm_engine.core.executor.runner.drafter
    drafter.force_drafts = forced
    try:
        outputs, (num_drafts, num_accepted) = run(llm, prompts, params, speculate=True)
    finally:
        drafter.force_drafts = None
    assert none == (0, 0) and 0 < num_accepted < num_drafts
    assert exact(outputs) == exact(reference)


def test_seeded_n2_equals_no_speculation_and_metrics(engine):
    llm, _ = engine
    params = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=16, ignore_eos=True)
    reference, _ = run(llm, PROMPTS[:2], params, speculate=False)
    outputs, (num_drafts, num_accepted) = run(llm, PROMPTS[:2], params, speculate=True)
    assert exact(outputs) == exact(reference) and num_drafts > 0
    metrics = {m.name: getattr(m, "values", None) or m.value for m in llm.get_metrics() if "spec_decode" in m.name}
    sched = llm.llm_engine.core.scheduler
    assert metrics["vllm:spec_decode_num_draft_tokens"] == sched.num_draft_tokens > 0
    assert metrics["vllm:spec_decode_num_accepted_tokens"] == sched.num_accepted_tokens
    assert len(metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]) == K  # a Vector, as vLLM's reader gives


def test_bad_heads_are_refused(target, tmp_path):
    def load(method, **config_changes):
        path = str(tmp_path / f"{method}-{len(config_changes)}")
        save_head(path, method == "eagle3")
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f) | config_changes
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
        spec = {"method": method, "model": path, "num_speculative_tokens": 2}
        LLM(
            target[1], dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 20, speculative_config=spec
        )

    with pytest.raises(ValueError, match=r"is a head for vocab_size=300 and hidden size 64; the target .* 320 and 64"):
        load("eagle", vocab_size=300)
    # vLLM's default layers (2, L // 2, L - 3) for the 4-layer target: (2, 2, 1)
    with pytest.raises(ValueError, match=r"eagle_aux_hidden_state_layer_ids=\[2, 2, 1\] must be 3 different layers"):
        load("eagle3", eagle_aux_hidden_state_layer_ids=None)


@pytest.mark.gpu
def test_gpu_graph_steps_feed_the_head_as_eager_ones(method, target, tmp_path):
    """On a GPU (float32): decode and verify steps replayed from CUDA graphs (the EAGLE-3 layers' copy is in the
    graph, in its padded row order) give the head what eager steps give, and the head's own passes replay graphs:
    the same proposals; outputs equal those without speculation."""
    path = str(tmp_path / method)
    save_head(path, method == "eagle3")
    spec = {"method": method, "model": path, "num_speculative_tokens": K}
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    proposals = []
    for eager in (False, True):
        llm = LLM(
            target[1], dtype="float32", skip_tokenizer_init=True, block_size=4, kv_cache_memory_bytes=1 << 24,
            speculative_config=spec, enforce_eager=eager,
        )  # fmt: skip
        runner = llm.llm_engine.core.executor.runner
        assert (runner.graphs is None) == eager
        calls = record_proposals(runner.drafter)
        reference, _ = run(llm, PROMPTS, params, speculate=False)
        outputs, (num_drafts, _) = run(llm, PROMPTS, params, speculate=True)
        assert exact(outputs) == exact(reference) and num_drafts > 0
        if not eager:  # verify steps and the head's passes replayed graphs
            assert runner.verify_graphs.num_replays > 0 and runner.drafter.graphs.num_replays > 0
            assert runner.drafter.first_graphs.num_replays > 0
        proposals.append(calls)
        del llm, runner
        gc.collect()
    assert proposals[0] == proposals[1] and len(proposals[0]) > len(PROMPTS)


def test_proposals_through_static_buffers_equal_the_oracle(method, target, forced, tmp_path):
    """The target's verify steps (for EAGLE-3: its layers' copy in the graph's padded row order) and the head's
    passes over the graph runners' static buffers (tests/static_graphs.py, no GPU): the proposals equal the oracle's,
    the outputs those without speculation."""
    from static_graphs import make_static

    path = str(tmp_path / method)
    weights = save_head(path, method == "eagle3")
    spec = {"method": method, "model": path, "num_speculative_tokens": K}
    llm = LLM(
        target[1], dtype="float32", skip_tokenizer_init=True, block_size=4, kv_cache_memory_bytes=1 << 22,
        speculative_config=spec,
    )  # fmt: skip
    make_static(llm)
    runner = llm.llm_engine.core.executor.runner
    drafter = runner.drafter
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    reference, _ = run(llm, PROMPTS[:3], params, speculate=False)
    calls = record_proposals(drafter)
    drafter.force_drafts = forced
    outputs, (num_drafts, num_accepted) = run(llm, PROMPTS[:3], params, speculate=True)
    assert exact(outputs) == exact(reference) and num_accepted > 0
    assert runner.verify_graphs.num_replays > 0 and drafter.first_graphs.num_replays > 0
    assert drafter.graphs.num_replays > 0 and len(calls) >= 8
    w = {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}
    for tokens, drafts in calls:
        assert drafts == oracle_drafts(target[0], w, method == "eagle3", tokens, forced.drafts(tokens)), tokens


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["TP=2", "PP=2"])
def test_parallel_driver_head_equals_the_oracle(method, target, forced, layout, tmp_path):
    """Two CPU processes (gloo). TP=2: the driver runs the head on whole copies of the target's embedding and LM
    head (gathered from the ranks' shards) and broadcasts its drafts, forced ones included. PP=2: the first stage's
    driver runs it on the final hidden states the last stage sends back (EAGLE-3: on the layers each stage copies,
    the later stage's sent back too). Its proposals equal the oracle's and the outputs equal those without
    speculation, logprobs included."""
    path = str(tmp_path / "head")
    weights = save_head(path, method == "eagle3")
    spec = {"method": method, "model": path, "num_speculative_tokens": K}
    llm = LLM(
        target[1], dtype="float32", skip_tokenizer_init=True, block_size=4, kv_cache_memory_bytes=1 << 22,
        speculative_config=spec, **layout,
    )  # fmt: skip
    try:
        drafter = llm.llm_engine.core.executor.runner.drafter
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
        reference, _ = run(llm, PROMPTS[:3], params, speculate=False)
        calls = record_proposals(drafter)
        drafter.force_drafts = forced
        outputs, (num_drafts, num_accepted) = run(llm, PROMPTS[:3], params, speculate=True)
    finally:
        llm.llm_engine.shutdown()
    assert len(calls) >= 12 and 0 < num_accepted < num_drafts
    assert exact(outputs) == exact(reference)
    w = {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}
    for tokens, drafts in calls:
        assert drafts == oracle_drafts(target[0], w, method == "eagle3", tokens, forced.drafts(tokens)), tokens
