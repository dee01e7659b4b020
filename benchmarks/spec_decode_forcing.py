"""The draft and EAGLE benchmark's dummy target and forced drafts (spec_decode_bench.py --method draft | eagle |
eagle3): a next-token map for the target with wide logit margins, so its greedy continuation is known without a run;
the drafter's hook that forces its drafts to agree with that continuation at a controlled rate; and the time split
of the engine's steps. Bench-only: it reaches the model and the runner through the engine objects (one process)."""

from __future__ import annotations

import bisect
import time

import numpy as np
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.layers.linear import pack_for_cpu

GOLDEN = (5**0.5 - 1) / 2  # the golden ratio's fraction: a low-discrepancy sequence's step


def successor_map(vocab_size: int, seed: int = 0) -> np.ndarray:
    """The dummy target's next-token map P, a seeded random permutation of the vocabulary. [vocab]"""
    return np.random.default_rng(seed).permutation(vocab_size)


@torch.inference_mode()
def install_successor_map(llm: LLM, perm: np.ndarray, seed: int = 0) -> None:
    """Makes the engine's dummy target follow perm greedily: embedding row t a seeded random vector of norm sqrt(H)
    (N(0, 1) entries, rescaled), LM head row perm[t] the same vector. The residual stream at a token t is embed[t]
    plus the dummy layers' small outputs, so the logit of perm[t] (|embed[t]|^2 = H) stands far above every other
    (a random cross product, ~N(0, H)): see the module docstring for the margin. Needs the target in this process
    (tensor_parallel_size=1) and an LM head of its own (not tied to the embedding)."""
    runner = getattr(llm.llm_engine.core.executor, "runner", None)
    if runner is None:
        raise ValueError("the draft/EAGLE benchmark rewrites the target's weights in this process: use TP=1")
    model = runner.model
    embed = getattr(model, model.model_attr).get_submodule(model.embedding_attr)
    head = getattr(model, model.head_attr)
    if head.tied or embed.weight.shape[0] != len(perm):
        raise ValueError(f"the target's LM head must be its own, over {len(perm)} rows, to carry a successor map")
    gen, weight = torch.Generator().manual_seed(seed), embed.weight.data  # [vocab, H]
    for first in range(0, len(perm), 16384):  # (in float32 on the host, a slice at a time: the same on any device)
        rows = torch.randn(min(16384, len(perm) - first), weight.shape[1], generator=gen)  # [rows, H]
        weight[first : first + len(rows)].copy_(rows * (weight.shape[1] ** 0.5 / rows.norm(dim=1, keepdim=True)))
    table = torch.empty_like(weight)
    table[torch.from_numpy(perm).to(weight.device)] = weight  # [vocab, H] lm_head[P[t]] = embed[t]
    if head.weight is not None:
        head.weight.data.copy_(table)
    if head.cpu_weight is not None:  # the CPU's oneDNN copy of the head (its weight may be gone)
        head.cpu_weight = pack_for_cpu(table)


def continuation(prompt: list[int], perm: np.ndarray, length: int) -> list[int]:
    """The target's greedy tokens after prompt under the successor map: P(t), P(P(t)), ... (t its last token)."""
    out, token = [], prompt[-1]
    for _ in range(length):
        token = int(perm[token])
        out.append(token)
    return out


def top2_margin(llm: LLM, prompts: list[dict], max_tokens: int) -> float:
    """The smallest gap between the target's two largest logits over its greedy tokens (an untimed run)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    gaps = []
    for output in llm.generate(prompts, params, use_tqdm=False):
        for entry in output.outputs[0].logprobs:
            best = sorted((lp.logprob for lp in entry.values()), reverse=True)
            gaps.append(best[0] - best[1])
    return min(gaps)


class ForcedAgreement:
    """The drafter's force_drafts hook: a proposal's K drafts are the target's greedy tokens there (the successor
    map's continuation of the request's prompt) up to the first that disagrees. Its position j (K: none) follows the
    law of K drafts each agreeing independently with probability `agree` (P(j) = agree^j (1 - agree), P(K) =
    agree^K), drawn per request from a golden-ratio sequence with a seeded offset: the runs' mean converges much
    faster than with independent draws, so a short run measures the rate asked for. A request whose tokens have left
    the continuation keeps the draft model's tokens (-1); num_followed / num_calls counts the proposals forced
    (1.0 while the target follows the map)."""

    def __init__(self, prompts: list[dict], perm: np.ndarray, length: int, agree: float, k: int) -> None:
        offsets = np.random.default_rng(0).random(len(prompts))
        self.seqs = {}  # prompt -> [prompt + its continuation, the golden-ratio offset, proposals so far]
        for p, offset in zip(prompts, offsets.tolist()):
            ids = p["prompt_token_ids"]
            self.seqs[tuple(ids)] = [ids + continuation(ids, perm, length + k), offset, 0]
        law = [agree**j * (1 - agree) for j in range(k)] + [agree**k]
        self.cdf = np.cumsum(law)[:-1].tolist()  # j = the number of these below a uniform draw
        self.prompt_len, self.k, self.vocab_size = len(prompts[0]["prompt_token_ids"]), k, len(perm)
        self.reset()

    def reset(self) -> None:
        """Counts and draws from the start (after a warm-up)."""
        self.num_calls = self.num_followed = 0
        self.known = {}  # id(a request's tokens) -> [those tokens, its entry, how many were checked]
        for entry in self.seqs.values():
            entry[2] = 0

    def _lookup(self, tokens: list[int]) -> list:
        """[tokens, its prompt's entry or None, tokens checked]: a request's token list is one object that only grows,
        so each call checks only its new tokens."""
        known = self.known.get(id(tokens))
        if known is None or known[0] is not tokens:
            known = self.known[id(tokens)] = [tokens, self.seqs.get(tuple(tokens[: self.prompt_len])), self.prompt_len]
        return known

    def __call__(self, histories: list[list[int]]) -> np.ndarray:
        out = np.full((len(histories), self.k), -1, dtype=np.int64)  # [m, K]
        for i, tokens in enumerate(histories):
            _, entry, checked = known = self._lookup(tokens)
            self.num_calls += 1
            n = len(tokens)
            if entry is None or n + self.k > len(entry[0]) or tokens[checked:n] != entry[0][checked:n]:
                continue
            known[2] = n
            self.num_followed += 1
            seq, offset, count = entry
            entry[2] += 1
            j = bisect.bisect_right(self.cdf, (offset + count * GOLDEN) % 1.0)  # drafts that agree
            out[i] = seq[n : n + self.k]
            if j < self.k:
                out[i, j] = (seq[n + j] + 1) % self.vocab_size
        return out


class StepSplit:
    """Times the runner's target forwards, its sampling (logits, sampler, verification) and a drafter's record of
    each step (an EAGLE head's pass over the step's hidden states) by kind of step: decode (one token a row), verify
    (drafts) or prefill: on a GPU device time between CUDA events (no synchronisation), on a CPU wall time; and the
    engine core's proposals (host wall time: a draft model's passes run on after it, its drafts staying on the
    device). Bench-only: it wraps the engine objects' methods."""

    def __init__(self, core) -> None:
        runner = core.executor.runner
        self.cuda, self.kind = runner.on_cuda, "decode"
        self.steps: dict[str, int] = {}
        self.seconds: dict[tuple[str, str], float] = {}  # (kind, part) -> seconds
        self.events: list[tuple[str, str, torch.cuda.Event, torch.cuda.Event]] = []
        plan = runner.plan_step

        def plan_step(so):
            one = max(so.num_scheduled_tokens.values()) == 1
            self.kind = "verify" if so.scheduled_spec_decode_tokens else "decode" if one else "prefill"
            self.steps[self.kind] = self.steps.get(self.kind, 0) + 1
            return plan(so)

        runner.plan_step = plan_step
        runner._run_model = self._timed("forward", runner._run_model)
        runner._sample = self._timed("sample", runner._sample)
        if getattr(runner, "drafter", None) is not None:  # an EAGLE head's pass over each step's hidden states
            runner.drafter.record_step = self._timed("propose", runner.drafter.record_step)
        propose = core._propose

        def timed_propose(proposer) -> None:  # (host wall time: it ends with the drafts' copy to the host)
            start_time = time.perf_counter()
            propose(proposer)
            self._add("all", "propose", time.perf_counter() - start_time)

        core._propose = timed_propose

    def _timed(self, part: str, fn):
        def timed_call(*args):
            kind = self.kind
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = fn(*args)
                end.record()
                self.events.append((kind, part, start, end))
                return out
            start_time = time.perf_counter()
            out = fn(*args)
            self._add(kind, part, time.perf_counter() - start_time)
            return out

        return timed_call

    def _add(self, kind: str, part: str, seconds: float) -> None:
        self.seconds[kind, part] = self.seconds.get((kind, part), 0.0) + seconds

    def take(self) -> tuple[dict[str, int], dict[tuple[str, str], float]]:
        """(steps by kind, seconds by (kind, part)) since the last take."""
        if self.events:
            torch.cuda.synchronize()
        for kind, part, start, end in self.events:
            self._add(kind, part, start.elapsed_time(end) / 1e3)
        out = (self.steps, self.seconds)
        self.steps, self.seconds, self.events = {}, {}, []
        return out


def check_follows_map(outputs: list[list[int]], prompts: list[dict], perm: np.ndarray) -> None:
    """The run without drafts produced the successor map's continuation of every prompt (else the forced drafts
    would not be the target's tokens)."""
    for i, (p, out) in enumerate(zip(prompts, outputs)):
        expected = continuation(p["prompt_token_ids"], perm, len(out))
        if out != expected:
            at = next(j for j, (a, b) in enumerate(zip(out, expected)) if a != b)
            raise RuntimeError(f"request {i}: the target's token {at} is {out[at]}, the successor map's {expected[at]}")
