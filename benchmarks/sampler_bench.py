"""Per-step time of pagedllm's sampler on a mixed batch against its own greedy step on the same logits.

Each workload is a persistent batch (the model runner's InputBatch) of --batch requests that decode step after step:
each step samples every request from fresh random float32 logits [--batch, --vocab] (made before timing), and the
sampled tokens join the requests (untimed, as the runner's commit). What a step times is the model runner's path
after the LM head, as it runs it: the StepSampler's prepare (on the GPU the kernel's inputs kept on the device,
uploading only what changed), needs_float32 and sample (the logprobs rows, adjust_logits, the sampling rules, the
logprobs), and the copy of the sampled tokens and the logprobs to the host with the lists the output processor reads.

Workload sampler-256x49152: with a fixed --seed each request draws greedy or temperature in [0.5, 1.5], top_k in
{0, 20, 50}, top_p in {1.0, 0.9, 0.95}, min_p in {0, 0.05}; a quarter each get a seed, repetition/presence/frequency
penalties, logprobs=5; each has a prompt of 200 tokens and 0-99 tokens generated already. Timed per step,
interleaved on the same logits:
  greedy        the batch with every request greedy and no penalties or logprobs
  argmax        torch's logits.argmax(-1) alone (slower than the sampler's greedy step on the CPU)
  filters_only  the mixed batch without its penalties and logprobs
  full          the mixed batch, as it goes on from the step before (no request joins or leaves)
  churn         the mixed batch where, before each step, --churn requests leave and as many new ones (of the same
                mix) join, as when requests finish in a running server; their joining is untimed (the runner's
                batch update), their first sampling step is timed
Medians after --warmup go out as one JSON line (appended to benchmarks/results.jsonl unless --no-append) with
ratio = full / greedy (the issue's target: <= 3), ratio_churn = churn / greedy and ratio_vs_argmax = full / argmax.
e.g. python benchmarks/sampler_bench.py --steps 5 --no-append

Workload sampler-plain-256x151936 (--workload plain): the common case of the GPU throughput benchmark, every request
at temperature 0.6 alone (no top-k/top-p/min-p, no seeds, penalties or logprobs) over a 151,936-token vocabulary
(Qwen's; --vocab overrides it)."""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

from pagedllm.device import HostCopies
from pagedllm.sample.step_sampler import StepSampler
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.scheduler_output import NewRequestData

try:
    from benchmarks.common import emit, git_commit, machine_description, make_record, rounded, usable_cores
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    from common import emit, git_commit, machine_description, make_record, rounded, usable_cores

TARGET_RATIO = 3.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=50, help="timed steps; the medians are reported (default 50)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--batch", type=int, default=256, help="requests per step (default 256)")
    p.add_argument("--workload", choices=["mixed", "plain"], default="mixed", help="the batch (default mixed)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 49152; plain: 151936)")
    p.add_argument("--seed", type=int, default=0, help="seed of the batch mix and the logits (default 0)")
    p.add_argument("--threads", type=int, default=usable_cores(), help="torch threads (default: all cores)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--churn", type=int, default=2, help="requests that leave and join before each churn step (2)")
    p.add_argument("--no-append", action="store_true", help="do not append to benchmarks/results.jsonl")
    args = p.parse_args(argv)
    if args.vocab is None:
        args.vocab = 151936 if args.workload == "plain" else 49152
    return args


PROMPT = 200  # prompt tokens of every request
MAX_MODEL_LEN = 4096


def request_params(rng: np.random.Generator, workload: str) -> SamplingParams:
    """One request's sampling parameters, drawn from the workload's mix."""
    if workload == "plain":
        return SamplingParams(temperature=0.6)
    quarter = lambda: rng.random() < 0.25  # noqa: E731
    greedy = rng.random() < 0.5
    fields = dict(
        temperature=0.0 if greedy else float(rng.uniform(0.5, 1.5)),
        top_k=int(rng.choice([0, 20, 50])),
        top_p=float(rng.choice([1.0, 0.9, 0.95])),
        min_p=float(rng.choice([0.0, 0.05])),
        seed=int(rng.integers(2**31)),
    )
    seeded, penalized, wants_logprobs = quarter(), quarter(), quarter()
    if not seeded:
        del fields["seed"]
    if penalized:
        fields |= dict(
            repetition_penalty=float(rng.uniform(1.05, 1.3)),
            presence_penalty=float(rng.uniform(0.0, 0.5)),
            frequency_penalty=float(rng.uniform(0.0, 0.5)),
        )
    if wants_logprobs:
        fields["logprobs"] = 5
    return SamplingParams(**fields)


class Workload:
    """A persistent batch of requests decoding step after step (the runner's InputBatch)."""

    def __init__(self, n: int, vocab: int, seed: int, workload: str, strip=None) -> None:
        self.rng = np.random.default_rng(seed)
        self.vocab, self.workload, self.strip = vocab, workload, strip
        self.batch = InputBatch(n, MAX_MODEL_LEN, 1)
        self.num_added = 0
        for _ in range(n):
            self.join()

    def join(self) -> None:
        """A new request of the mix: a prompt and 0-99 tokens generated already."""
        params = request_params(self.rng, self.workload)
        if self.strip is not None:
            params = self.strip(params)
        tokens = self.rng.integers(self.vocab, size=PROMPT + int(self.rng.integers(100))).tolist()
        self.batch.add(NewRequestData(f"r{self.num_added}", tokens, PROMPT, params, [], len(tokens), []))
        self.num_added += 1

    def churn(self, k: int) -> None:
        """k requests leave (the oldest) and k new ones join."""
        for req_id in list(self.batch.row_of)[:k]:
            self.batch.remove(req_id)
        for _ in range(k):
            self.join()

    def rows(self) -> np.ndarray:
        return np.array(list(self.batch.row_of.values()), dtype=np.int64)

    def commit(self, rows: np.ndarray, tokens: list[int]) -> None:
        for row, token in zip(rows.tolist(), tokens):
            self.batch.append_token(row, token)


def greedy_params(params: SamplingParams) -> SamplingParams:
    return SamplingParams(temperature=0.0)


def filters_params(params: SamplingParams) -> SamplingParams:
    """The request's filters and seed, without its penalties and logprobs."""
    return SamplingParams(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p, seed=params.seed
    )


def sampler_step(sampler: StepSampler, rows: np.ndarray, raw: torch.Tensor, host_copies: HostCopies) -> list[int]:
    """What the model runner does after the LM head for these rows of the batch, through the host's copy of the
    sampled tokens and the logprobs lists (the tokens join the requests afterwards, untimed)."""
    step = sampler.prepare(rows, sampler.batch.num_tokens[rows])
    sampler.needs_float32(step)
    out = sampler.sample(raw, step)
    sampled, logprobs = out.sampled, out.logprobs
    pinned = None
    if sampled.is_cuda:  # as the runner's StepFuture: copies to pinned memory (one where they share a buffer)
        if logprobs is None:
            (sampled,), pinned = host_copies.copy(sampled)
        else:
            (sampled, logprobs.packed), pinned = host_copies.copy(sampled, logprobs.packed)
        torch.cuda.current_stream().synchronize()
    tokens = sampled.tolist()
    if logprobs is not None:
        logprobs.tolists()
    host_copies.give_back(pinned)
    return tokens


def timed_ms(fn, device: torch.device) -> float:
    """Wall time of fn, waiting for the device's queued work before and after."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - start) * 1e3


@torch.inference_mode()
def run(args: argparse.Namespace) -> dict[str, float]:
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    logits_gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    works = {  # each with a sampler of its own (its own state kept on the device)
        "greedy": Workload(args.batch, args.vocab, args.seed, args.workload, greedy_params),
        "filters_only": Workload(args.batch, args.vocab, args.seed, args.workload, filters_params),
        "full": Workload(args.batch, args.vocab, args.seed, args.workload),
        "churn": Workload(args.batch, args.vocab, args.seed, args.workload),
    }
    samplers = {name: StepSampler(work.batch, device, args.seed) for name, work in works.items()}
    host_copies = {name: HostCopies() for name in works}  # the runner's
    times: dict[str, list[float]] = {name: [] for name in ["greedy", "argmax", "filters_only", "full", "churn"]}
    for step in range(args.warmup + args.steps):
        raw = torch.randn(args.batch, args.vocab, generator=logits_gen, device=device).mul_(3.0)  # untimed
        works["churn"].churn(args.churn)
        row = {"argmax": timed_ms(lambda raw=raw: raw.argmax(-1), device)}
        for name, work in works.items():  # full and churn may write into their logits (the torch path's penalties)
            logits = raw if name == "greedy" else raw.clone()
            rows, tokens = work.rows(), []  # the rows: the runner has them from its flat batch
            step_fn = lambda s=samplers[name], r=rows, x=logits, t=tokens, h=host_copies[name]: t.extend(  # noqa: E731
                sampler_step(s, r, x, h)
            )
            row[name] = timed_ms(step_fn, device)
            work.commit(rows, tokens)
        if step >= args.warmup:
            for name, ms in row.items():
                times[name].append(ms)
    return {name: statistics.median(v) for name, v in times.items()}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    med = run(args)
    ratio = med["full"] / med["greedy"]
    record = make_record(
        f"sampler-{'plain-' if args.workload == 'plain' else ''}{args.batch}x{args.vocab}",
        machine_description(),
        git_commit(),
        greedy_ms=rounded(med["greedy"], 3),
        argmax_ms=rounded(med["argmax"], 3),
        full_ms=rounded(med["full"], 3),
        filters_only_ms=rounded(med["filters_only"], 3),
        churn_ms=rounded(med["churn"], 3),
        ratio=rounded(ratio, 3),
        ratio_churn=rounded(med["churn"] / med["greedy"], 3),
        ratio_vs_argmax=rounded(med["full"] / med["argmax"], 3),
        steps=args.steps,
        threads=args.threads,
        device=args.device,
        warmup=args.warmup,
        seed=args.seed,
        churn=args.churn,
    )
    emit(record, append=not args.no_append)
    print(f"\n{record['workload']}: median over {args.steps} steps, {args.threads} threads", file=sys.stderr)
    print(f"{'step':<14}{'ms':>10}{'x greedy':>10}", file=sys.stderr)
    for name in ("greedy", "argmax", "filters_only", "full", "churn"):
        print(f"{name:<14}{med[name]:>10.2f}{med[name] / med['greedy']:>10.2f}", file=sys.stderr)
    verdict = "meets" if ratio <= TARGET_RATIO else "misses"
    print(f"ratio full/greedy {ratio:.2f} {verdict} the target <= {TARGET_RATIO:g}", file=sys.stderr)


if __name__ == "__main__":
    main()
