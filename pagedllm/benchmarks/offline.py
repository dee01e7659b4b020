"""`pagedllm bench latency` and `pagedllm bench throughput`: the offline engine timed as vLLM's benchmarks time it,
with vLLM's flags (every engine flag too) and result fields, printed as one JSON line (and to --output-json)."""

from __future__ import annotations

import argparse
import json
import time

from pagedllm.benchmarks.datasets import add_dataset_args, random_requests, sample_requests
from pagedllm.engine_args import EngineArgs

PERCENTILES = (10, 25, 50, 75, 90, 99)


def timed_generate(llm, prompts: list, params) -> tuple[list, float]:
    """(outputs, wall seconds) of one llm.generate, the device synchronized before and after."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    return outputs, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation (numpy's default), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _engine(args: argparse.Namespace):
    from pagedllm import LLM

    return LLM(args.model, **EngineArgs.cli_kwargs(args))


def _vocab_size(llm) -> int:
    return int(llm.llm_engine.config.model.hf_config.vocab_size)


def _report(result: dict, output_json: str | None) -> int:
    print(json.dumps(result), flush=True)
    if output_json:
        with open(output_json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


def _latency(args: argparse.Namespace) -> int:
    from pagedllm import BeamSearchParams, SamplingParams

    for name in ("input_len", "output_len", "batch_size", "n", "num_iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
    llm = _engine(args)
    tokenizer = llm.get_tokenizer()
    special = set(getattr(tokenizer, "all_special_ids", None) or [])
    batch = random_requests(
        _vocab_size(llm), args.batch_size, args.input_len, 1, seed=getattr(args, "seed", 0), special_ids=special
    )
    prompts = [r.engine_prompt() for r in batch]
    if args.use_beam_search:
        beam = BeamSearchParams(beam_width=args.n, max_tokens=args.output_len, ignore_eos=True)
        run = lambda: llm.beam_search(prompts, beam)  # noqa: E731
    else:
        params = SamplingParams(
            n=args.n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len,
            detokenize=not args.disable_detokenize,
        )  # fmt: skip
        run = lambda: timed_generate(llm, prompts, params)  # noqa: E731
    for _ in range(args.num_iters_warmup):
        run()
    if args.profile:
        return _profile(llm, run)
    latencies = []
    for _ in range(args.num_iters):
        start = time.perf_counter()
        run()
        latencies.append(time.perf_counter() - start)
    result = {
        "avg_latency": sum(latencies) / len(latencies),
        "latencies": latencies,
        "percentiles": {str(q): percentile(latencies, q) for q in PERCENTILES},
    }
    return _report(result, args.output_json)


def _profile(llm, run) -> int:
    """One run under the torch profiler; the trace (one per rank) goes to VLLM_TORCH_PROFILER_DIR, as vLLM's
    --profile."""
    from pagedllm.profiler import profiler_from_env

    profiler = profiler_from_env(llm.llm_engine)
    profiler.start()
    run()
    profiler.stop()
    print(json.dumps({"profile": profiler.trace_dir}), flush=True)
    return 0


def _throughput(args: argparse.Namespace) -> int:
    if args.backend != "vllm":
        raise ValueError(f"--backend={args.backend!r} is not supported: only 'vllm' (this engine)")
    if args.n < 1:
        raise ValueError(f"--n={args.n} must be at least 1")
    llm = _engine(args)
    requests = sample_requests(args, _vocab_size(llm), llm.get_tokenizer())
    result = run_throughput(llm, requests, args.n, not args.disable_detokenize)
    return _report(result, args.output_json)


def run_throughput(llm, requests: list, n: int = 1, detokenize: bool = True) -> dict:
    """vLLM's benchmark_throughput on a built engine: every request at once (temperature 1, top_p 1, ignore_eos,
    each its own output length), timed as one generate; vLLM's result fields."""
    from pagedllm import SamplingParams

    prompts = [r.engine_prompt() for r in requests]
    params = [
        SamplingParams(n=n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=r.output_len, detokenize=detokenize)
        for r in requests
    ]
    outputs, elapsed = timed_generate(llm, prompts, params)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {
        "elapsed_time": elapsed,
        "num_requests": len(requests),
        "total_num_tokens": prompt_tokens + output_tokens,
        "total_output_tokens": output_tokens,
        "requests_per_second": len(requests) / elapsed,
        "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
    }


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory, .gguf file or repo id (default: bundled)")
    parser.add_argument("--output-json", default=None, help="also write the result to this JSON file")
    parser.add_argument("--disable-detokenize", action="store_true", help="time without detokenizing outputs")
    parser.add_argument("--n", type=int, default=1, help="sequences per prompt")
    EngineArgs.add_cli_args(parser)


def add_offline_parsers(sub) -> None:
    lat = sub.add_parser("latency", help="the latency of one batch (vLLM's benchmark_latency)")
    lat.add_argument("--input-len", type=int, default=32)
    lat.add_argument("--output-len", type=int, default=128)
    lat.add_argument("--batch-size", type=int, default=8)
    lat.add_argument("--use-beam-search", action="store_true")
    lat.add_argument("--num-iters-warmup", type=int, default=10)
    lat.add_argument("--num-iters", type=int, default=30)
    lat.add_argument("--profile", action="store_true", help="one run under the torch profiler")
    _common(lat)
    lat.set_defaults(func=_latency)
    thr = sub.add_parser("throughput", help="offline throughput over a dataset (vLLM's benchmark_throughput)")
    thr.add_argument("--backend", default="vllm", help="only 'vllm' (this engine)")
    add_dataset_args(thr, input_len=1024, output_len=128, num_prompts=1000, seed_flag=False)
    _common(thr)
    thr.set_defaults(func=_throughput)
