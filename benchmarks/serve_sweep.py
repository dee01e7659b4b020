"""Online serving: `pagedllm serve` (Llama-3.1-8B shapes, dummy bf16 weights) under Poisson arrivals at rising
request rates, against the offline engine's throughput and batch-1 step time measured in the same run.

Method, in order:
 1. Offline, in a child process with the server's engine flags (--engine-args): a warm-up, then
    `run_throughput` (what `pagedllm bench throughput` times: every request at once, ignore_eos) over
    --offline-prompts requests of the serving lengths (random ids, input --input-len +/- --range-ratio, output
    --output-len +/- --range-ratio, seed 0): offline output tok/s and requests/s; then one request alone (input
    --input-len, 129 tokens out) whose batch-1 step time is (last_token_time - first_token_time) / 128 from its
    RequestOutput.metrics. The child exits (its GPU memory freed) before the server starts.
 2. `pagedllm serve` started on 127.0.0.1 with the same flags (the model folder: the config plus
    benchmarks/dummy_model.py's word-level tokenizer, so the stream carries text for every token).
 3. Per rate (--rates, plus r90 = 0.9 x the offline requests/s: the rate at which the server is asked for 90% of
    the offline engine's throughput): `pagedllm bench serve` (pagedllm/benchmarks/serve.py's run_benchmark:
    Poisson arrivals, the same random lengths, ignore_eos, temperature 0, streamed /v1/completions) with
    min(--num-prompts, max(20, rate x --max-seconds-per-rate)) requests: throughput, TTFT and ITL p50 / p99. One
    JSON line per rate (serve-sweep-rate-<rate>).
 4. A summary line (serve-sweep): the offline figures, the first swept rate whose p99 TTFT passes 1 s (and the
    rate interpolated linearly between the two rates around 1 s), at r90: the served throughput as a fraction of
    the offline one and p99 ITL / batch-1 step time (goal <= 2: no stalls from prefills; the chunked-prefill
    budget, --max-num-batched-tokens in --engine-args, decides it), and the PNG plot (--plot; needs matplotlib) of
    latency percentiles and throughput against the rate; each rate's result is also saved beside it
    (<plot stem>-<rate>qps.json: `pagedllm bench plot` redraws the PNG where matplotlib is missing). The server is
    stopped at the end (also on failure).

    python benchmarks/serve_sweep.py --no-append                           # ~4 min on an H100
    python benchmarks/serve_sweep.py --engine-args "--max-model-len 4096 --max-num-batched-tokens 1024" --no-append
    python benchmarks/serve_sweep.py --bundled --rates 1,4 --input-len 32 --output-len 8 --num-prompts 8 \\
        --offline-prompts 8 --engine-args "--max-model-len 512" --plot sweep.png --no-append  # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    from benchmarks.common import BENCH_DIR, REPO_ROOT, emit, git_commit, machine_description, make_record, rounded
    from benchmarks.dummy_model import with_tokenizer
    from benchmarks.serve_bench import start_server
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    from common import BENCH_DIR, REPO_ROOT, emit, git_commit, machine_description, make_record, rounded
    from dummy_model import with_tokenizer
    from serve_bench import start_server

TTFT_LIMIT_MS = 1000.0
ITL_GOAL = 2.0  # p99 ITL at r90 over the batch-1 step time
BATCH1_TOKENS = 129


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(BENCH_DIR / "configs" / "llama-3.1-8b"), help="config folder (dummy)")
    p.add_argument("--bundled", action="store_true", help="the bundled SmolLM2 GGUF instead (CPU smoke)")
    p.add_argument("--engine-args", default="--max-model-len 4096", help="engine flags of the server and offline")
    p.add_argument("--rates", default="2,4,8,16,32", help="comma-separated request rates (requests/s)")
    p.add_argument("--num-prompts", type=int, default=100, help="most requests per rate")
    p.add_argument("--max-seconds-per-rate", type=float, default=25.0, help="fewer requests at low rates")
    p.add_argument("--offline-prompts", type=int, default=200)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--range-ratio", type=float, default=0.5, help="lengths in [len*(1-r), len*(1+r)]")
    p.add_argument("--plot", default="serve_sweep.png", help="the PNG to write")
    p.add_argument("--no-append", action="store_true", help="do not append to benchmarks/results.jsonl")
    p.add_argument("--offline-json", default=None, help=argparse.SUPPRESS)  # the child of step 1
    args = p.parse_args(argv)
    try:
        args.rates = [float(r) for r in args.rates.split(",") if r]
    except ValueError:
        p.error(f"--rates={args.rates!r}: comma-separated positive numbers")
    if not args.rates or min(args.rates) <= 0:
        p.error(f"--rates={args.rates!r}: comma-separated positive numbers")
    return args


def prompts_for(rate: float, args: argparse.Namespace) -> int:
    """Requests at this rate: --num-prompts, fewer where they would take longer than --max-seconds-per-rate."""
    return min(args.num_prompts, max(20, math.ceil(rate * args.max_seconds_per_rate)))


def ttft_crossing(rows: list[dict], limit_ms: float = TTFT_LIMIT_MS) -> tuple[float | None, float | None]:
    """(first rate whose p99 TTFT passes limit_ms, that rate interpolated linearly between the last rate under the
    limit and the first over it); (None, None) when no rate passes it. rows: {"rate", "p99_ttft_ms"} sorted."""
    below = None
    for row in rows:
        if row["p99_ttft_ms"] > limit_ms:
            if below is None:
                return row["rate"], None
            r0, t0 = below["rate"], below["p99_ttft_ms"]
            r1, t1 = row["rate"], row["p99_ttft_ms"]
            return row["rate"], r0 + (limit_ms - t0) * (r1 - r0) / (t1 - t0)
        below = row
    return None, None


def engine_kwargs(engine_args: str) -> dict:
    from pagedllm.engine_args import EngineArgs

    parser = argparse.ArgumentParser(prog="--engine-args")
    EngineArgs.add_cli_args(parser)
    return EngineArgs.cli_kwargs(parser.parse_args(shlex.split(engine_args)))


def offline_child(args: argparse.Namespace, model: str | None) -> dict:
    """Step 1 (in the child process): offline throughput and the batch-1 step time."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.benchmarks.datasets import random_requests
    from pagedllm.benchmarks.offline import run_throughput, timed_generate

    kwargs = engine_kwargs(args.engine_args) | ({"load_format": "dummy"} if model else {})
    llm = LLM(model, **kwargs)
    vocab = int(llm.llm_engine.config.model.vocab_size)
    special = set(getattr(llm.get_tokenizer(), "all_special_ids", None) or [])
    warm = SamplingParams(max_tokens=8, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [100 + i] * (20 + 30 * i)} for i in range(8)], warm, use_tqdm=False)
    requests = random_requests(
        vocab, args.offline_prompts, args.input_len, args.output_len, args.range_ratio, seed=0, special_ids=special
    )
    result = run_throughput(llm, requests)
    alone = random_requests(vocab, 1, args.input_len, BATCH1_TOKENS, seed=1, special_ids=special)[0]
    params = SamplingParams(temperature=0, max_tokens=BATCH1_TOKENS, ignore_eos=True)
    (out,), _ = timed_generate(llm, [alone.engine_prompt()], params)
    m = out.metrics
    result["batch1_step_ms"] = 1000 * (m.last_token_time - m.first_token_time) / (len(out.outputs[0].token_ids) - 1)
    llm.llm_engine.shutdown()
    return result


def run_offline(args: argparse.Namespace, model: str | None, scratch: str) -> dict:
    out = Path(scratch) / "offline.json"
    argv = [sys.executable, __file__, "--offline-json", str(out), "--engine-args", args.engine_args]
    argv += ["--offline-prompts", str(args.offline_prompts), "--input-len", str(args.input_len)]
    argv += ["--output-len", str(args.output_len), "--range-ratio", str(args.range_ratio)]
    argv += ["--bundled"] if args.bundled else ["--model", model]
    subprocess.run(argv, cwd=REPO_ROOT, check=True)
    return json.loads(out.read_text(encoding="utf-8"))


def serve_rate(url: str, rate: float, args: argparse.Namespace, model: str | None) -> dict:
    from pagedllm.benchmarks.serve import run_benchmark

    argv = ["--base-url", url, "--request-rate", str(rate), "--num-prompts", str(prompts_for(rate, args))]
    argv += ["--input-len", str(args.input_len), "--output-len", str(args.output_len), "--ignore-eos"]
    argv += ["--random-range-ratio", str(args.range_ratio), "--metric-percentiles", "50,99"]
    argv += ["--percentile-metrics", "ttft,itl", "--label", "pagedllm serve"]
    argv += ["--tokenizer", model] if model else []
    return run_benchmark(argv)


def rate_figures(result: dict) -> dict:
    keep = ("completed", "failed", "duration", "request_throughput", "output_throughput", "total_token_throughput")
    figures = {k: rounded(result[k], 3) if isinstance(result[k], float) else result[k] for k in keep}
    for metric in ("ttft", "itl"):
        for stat in ("p50", "p99"):
            figures[f"{stat}_{metric}_ms"] = rounded(result[f"{stat}_{metric}_ms"], 2)
    return figures | {"median_tpot_ms": rounded(result["median_tpot_ms"], 2), "errors": result["errors"]}


def summary(rows: list[dict], offline: dict, r90: float, r90_row: dict, plot: str) -> dict:
    first_over, interpolated = ttft_crossing(sorted(rows, key=lambda r: r["rate"]))
    step = offline["batch1_step_ms"]
    return {
        "offline_output_tok_s": rounded(offline["output_tokens_per_second"], 1),
        "offline_requests_per_s": rounded(offline["requests_per_second"], 3),
        "batch1_step_ms": rounded(step, 3),
        "rates": [r["rate"] for r in rows],
        "rate_p99_ttft_over_1s": first_over,
        "rate_p99_ttft_1s_interpolated": rounded(interpolated, 2),
        "r90": rounded(r90, 3),
        "r90_output_frac_of_offline": rounded(r90_row["output_throughput"] / offline["output_tokens_per_second"], 3),
        "r90_p99_itl_ms": r90_row["p99_itl_ms"],
        "r90_p99_itl_over_batch1_step": rounded(r90_row["p99_itl_ms"] / step, 2),
        "itl_goal": ITL_GOAL,
        "plot": plot,
    }


def sweep(args: argparse.Namespace, model: str | None, offline: dict) -> tuple[list[dict], list[dict], float]:
    """Steps 2 and 3: the server up, one run per rate (r90 included), the server stopped."""
    server_args = argparse.Namespace(model=model, server_args=args.engine_args + (" --load-format dummy" * bool(model)))
    proc, url = start_server(server_args)
    r90 = 0.9 * offline["requests_per_second"]
    results, rows = [], []
    try:
        for rate in sorted({*args.rates, round(r90, 3)}):
            result = serve_rate(url, rate, args, model)
            results.append(result)
            rows.append({"rate": rate, **rate_figures(result), "num_prompts": result["num_prompts"]})
    finally:
        proc.terminate()
        proc.wait(60)
    return results, rows, round(r90, 3)


def save_and_plot(results: list[dict], args: argparse.Namespace, title: str) -> str | None:
    """Each rate's `bench serve` result as <plot stem>-<rate>qps.json (what `pagedllm bench plot` reads) and the
    PNG; None for the PNG where matplotlib is missing (then `pagedllm bench plot *.json -o PNG` draws it later)."""
    from pagedllm.benchmarks.plot import plot_serving

    stem = Path(args.plot).with_suffix("")
    for result in results:
        Path(f"{stem}-{result['request_rate']:g}qps.json").write_text(json.dumps(result), encoding="utf-8")
    try:
        plot_serving(results, args.plot, title)
    except ValueError as e:  # matplotlib missing: the results stay
        print(f"no plot: {e}", file=sys.stderr)
        return None
    return args.plot


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.offline_json:  # the child of step 1: --model is the parent's folder (with its tokenizer)
        result = offline_child(args, None if args.bundled else args.model)
        Path(args.offline_json).write_text(json.dumps(result), encoding="utf-8")
        return 0
    with tempfile.TemporaryDirectory(prefix="serve-sweep-") as scratch:
        model = None if args.bundled else with_tokenizer(args.model, str(Path(scratch) / "model"))
        machine, commit = machine_description(), git_commit()
        offline = run_offline(args, model, scratch)
        results, rows, r90 = sweep(args, model, offline)
    name = "bundled" if args.bundled else Path(args.model).name
    common = {"model": name, "engine_args": args.engine_args, "input_len": args.input_len}
    common |= {"output_len": args.output_len, "range_ratio": args.range_ratio}
    for row in rows:
        emit(make_record(f"serve-sweep-rate-{row['rate']:g}", machine, commit, **row, **common), not args.no_append)
    plot = save_and_plot(results, args, f"pagedllm serve, {name}: input {args.input_len}, output {args.output_len}")
    r90_row = next(r for r in rows if r["rate"] == r90)
    figures = summary(rows, offline, r90, r90_row, plot)
    emit(make_record("serve-sweep", machine, commit, **figures, **common), append=not args.no_append)
    return 0


if __name__ == "__main__":
    sys.exit(main())
