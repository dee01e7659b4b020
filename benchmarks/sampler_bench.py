"""Per-step time of pagedllm's sampler on a mixed batch against its own greedy step on the same logits.

Workload sampler-256x49152: fresh random float32 logits [--batch, --vocab] each step (made before timing). With a
fixed --seed each request draws greedy or temperature in [0.5, 1.5], top_k in {0, 20, 50}, top_p in {1.0, 0.9,
0.95}, min_p in {0, 0.05}; a quarter each get a seed, repetition/presence/frequency penalties
(200 prompt + 100 output tokens), logprobs=5. Timed per step, interleaved on the same logits:
  greedy        the engine's greedy step: SamplingMetadata of the batch with every request greedy + the Sampler call
  argmax        torch's logits.argmax(-1) alone (slower than the sampler's greedy step on the CPU)
  filters_only  SamplingMetadata + the Sampler call
  full          all the model runner does after the LM head: SamplingMetadata with the penalties and the logprobs
                requests, the copy of the logprobs rows that the penalties change in place (none in the GPU kernel,
                which penalizes copies; all of them on the torch path), apply_token_constraints (no-op inputs), the
                Sampler (penalties, draws; on the GPU the logprobs too), sampled_logprobs (read on the host)
Medians after --warmup go out as one JSON line (appended to benchmarks/results.jsonl unless --no-append) with
ratio = full / greedy (the issue's target: <= 3) and ratio_vs_argmax = full / argmax (the ratio of earlier records,
whose greedy was torch's argmax).   e.g. python benchmarks/sampler_bench.py --steps 5 --no-append

Workload sampler-plain-256x151936 (--workload plain): the common case of the GPU throughput benchmark, every request
at temperature 0.6 alone (no top-k/top-p/min-p, no seeds, penalties or logprobs) over a 151,936-token vocabulary
(Qwen's; --vocab overrides it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

from pagedllm.sample.logits_processors import Penalties, apply_token_constraints
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler
from pagedllm.worker.sample_inputs import logprob_rows, sampled_logprobs

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
    p.add_argument("--no-append", action="store_true", help="do not append to benchmarks/results.jsonl")
    args = p.parse_args(argv)
    if args.vocab is None:
        args.vocab = 151936 if args.workload == "plain" else 49152
    return args


def build_batch(n: int, vocab: int, seed: int, workload: str = "mixed") -> dict:
    if workload == "plain":
        return plain_batch(n)
    rng = np.random.default_rng(seed)
    quarter = lambda: rng.random(n) < 0.25  # noqa: E731
    greedy = rng.random(n) < 0.5
    seeded, penalized, wants_lp = quarter(), quarter(), quarter()
    pen = np.nonzero(penalized)[0]
    floats = lambda lo, hi: rng.uniform(lo, hi, len(pen)).astype(np.float32)  # noqa: E731
    return {
        "temperature": np.where(greedy, 0.0, rng.uniform(0.5, 1.5, n)).astype(np.float32),
        "top_k": rng.choice([0, 20, 50], n).astype(np.int64),
        "top_p": rng.choice([1.0, 0.9, 0.95], n).astype(np.float32),
        "min_p": rng.choice([0.0, 0.05], n).astype(np.float32),
        "seeded": seeded,
        "seeds": rng.integers(2**31, size=n).astype(np.int64),
        "positions": rng.integers(100, size=n).astype(np.int64),
        "pen_rows": pen,
        "adjusted": penalized,
        "token_ids": rng.integers(vocab, size=(len(pen), 300)).astype(np.int64),  # as the batch holds them
        "num_prompt": np.full(len(pen), 200),
        "num_tokens": np.full(len(pen), 300),
        "repetition": floats(1.05, 1.3),
        "presence": floats(0.0, 0.5),
        "frequency": floats(0.0, 0.5),
        "num_logprobs": np.where(wants_lp, 5, -1),  # as the batch holds it (-1: none)
    }


def plain_batch(n: int) -> dict:
    """Every request at temperature 0.6 alone."""
    empty = np.zeros((0, 1), dtype=np.int64)
    return {
        "temperature": np.full(n, 0.6, dtype=np.float32),
        "top_k": np.zeros(n, dtype=np.int64),
        "top_p": np.ones(n, dtype=np.float32),
        "min_p": np.zeros(n, dtype=np.float32),
        "seeded": np.zeros(n, dtype=bool),
        "seeds": np.zeros(n, dtype=np.int64),
        "positions": np.zeros(n, dtype=np.int64),
        "pen_rows": np.zeros(0, dtype=np.int64),
        "adjusted": np.zeros(n, dtype=bool),
        "token_ids": empty,
        "num_prompt": np.zeros(0, dtype=np.int64),
        "num_tokens": np.zeros(0, dtype=np.int64),
        "repetition": np.zeros(0, dtype=np.float32),
        "presence": np.zeros(0, dtype=np.float32),
        "frequency": np.zeros(0, dtype=np.float32),
        "num_logprobs": np.full(n, -1),
    }


def metadata(b: dict, extras: bool = False) -> SamplingMetadata:
    """As sample_inputs.sampling_metadata builds it each step, from the persistent batch's numpy arrays (extras: with
    the penalties and the logprobs requests)."""
    penalties = num_top = None
    if extras:
        if len(b["pen_rows"]):
            penalties = Penalties(
                b["pen_rows"], b["token_ids"], b["num_prompt"], b["num_tokens"], b["repetition"], b["presence"],
                b["frequency"],
            )  # fmt: skip
        num_top = b["num_logprobs"]
    return SamplingMetadata.build(
        b["temperature"], b["top_k"], b["top_p"], b["min_p"], b["seeds"], b["seeded"], b["positions"], b["device"],
        penalties, num_top,
    )  # fmt: skip


def full_step(sampler: Sampler, b: dict, raw: torch.Tensor) -> torch.Tensor:
    """The model runner's path after compute_logits, on the batch's token arrays."""
    meta = metadata(b, extras=True)
    adjusted = b["adjusted"] if meta.penalizes_in_place else np.zeros_like(b["adjusted"])
    lp_rows = logprob_rows(raw, b["num_logprobs"], adjusted, sampler.c_scratch)  # before the logits change in place
    logits = apply_token_constraints(raw, {}, {}, {})
    sampled = sampler(logits, meta, lp_rows.copied if lp_rows is not None else None)
    sampled_logprobs(lp_rows, sampled, b["num_logprobs"], sampler.c_scratch, meta)
    return sampled


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
    b = build_batch(args.batch, args.vocab, args.seed, args.workload)
    b["device"] = device
    sampler = Sampler(device, args.seed)
    logits_gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    greedy = dict(b, temperature=np.zeros_like(b["temperature"]))
    times: dict[str, list[float]] = {"greedy": [], "argmax": [], "filters_only": [], "full": []}
    for step in range(args.warmup + args.steps):
        raw = torch.randn(args.batch, args.vocab, generator=logits_gen, device=device).mul_(3.0)  # untimed
        row = {
            "greedy": timed_ms(lambda raw=raw: sampler(raw, metadata(greedy)), device),
            "argmax": timed_ms(lambda raw=raw: raw.argmax(-1), device),
            "filters_only": timed_ms(lambda raw=raw: sampler(raw, metadata(b)), device),
            "full": timed_ms(lambda raw=raw: full_step(sampler, b, raw), device),  # last: it may write into raw
        }
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
        ratio=rounded(ratio, 3),
        ratio_vs_argmax=rounded(med["full"] / med["argmax"], 3),
        steps=args.steps,
        threads=args.threads,
        device=args.device,
        warmup=args.warmup,
        seed=args.seed,
    )
    emit(record, append=not args.no_append)
    print(f"\n{record['workload']}: median over {args.steps} steps, {args.threads} threads", file=sys.stderr)
    print(f"{'step':<14}{'ms':>10}{'x greedy':>10}", file=sys.stderr)
    for name in ("greedy", "argmax", "filters_only", "full"):
        print(f"{name:<14}{med[name]:>10.2f}{med[name] / med['greedy']:>10.2f}", file=sys.stderr)
    verdict = "meets" if ratio <= TARGET_RATIO else "misses"
    print(f"ratio full/greedy {ratio:.2f} {verdict} the target <= {TARGET_RATIO:g}", file=sys.stderr)


if __name__ == "__main__":
    main()
