"""`pagedllm bench serve`: a running OpenAI-compatible server under a stream of requests (vLLM's
benchmark_serving): requests arrive at --request-rate (Poisson, or gamma with --burstiness; inf: all at once), at
most --max-concurrency in flight, each streamed; TTFT, TPOT, ITL and end-to-end latency summarized as vLLM does
(mean / median / std / percentiles in ms) and printed as one JSON line."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import statistics
import time
from dataclasses import dataclass, field

from pagedllm.benchmarks.datasets import BenchRequest, add_dataset_args, sample_requests
from pagedllm.benchmarks.offline import percentile

ENDPOINTS = {"/v1/completions": False, "/v1/chat/completions": True}  # endpoint -> is chat
BACKENDS = {"vllm": "/v1/completions", "openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestResult:
    success: bool = False
    ttft: float = 0.0  # seconds to the first streamed text
    itl: list[float] = field(default_factory=list)  # gaps between the later streamed chunks
    latency: float = 0.0
    prompt_len: int = 0
    output_tokens: int = 0
    error: str = ""


async def stream_request(client, model: str, prompt, max_tokens: int, chat: bool = False, **extra) -> RequestResult:
    """One streamed request (`prompt`: text, or token ids for completions); its timings and token counts (the
    usage chunk's), or success False with the error."""
    result, start, last = RequestResult(), time.perf_counter(), None
    body = dict(model=model, max_tokens=max_tokens, stream=True, stream_options={"include_usage": True}, **extra)
    try:
        if chat:
            stream = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **body)
        else:
            stream = await client.completions.create(prompt=prompt, **body)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                result.prompt_len, result.output_tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
            text = (chunk.choices[0].delta.content if chat else chunk.choices[0].text) if chunk.choices else None
            if not text:
                continue
            if last is None:
                result.ttft = now - start
            else:
                result.itl.append(now - last)
            last = now
        result.latency, result.success = time.perf_counter() - start, True
    except Exception as e:  # the openai client's HTTP and connection errors: counted as failed requests
        result.error = f"{type(e).__name__}: {e}"
    return result


def arrival_gaps(num: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds before each next request: 0 for an infinite rate, else gamma(burstiness, 1 / (rate * burstiness))
    draws (burstiness 1: a Poisson process)."""
    if request_rate == float("inf"):
        return [0.0] * num
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness)) for _ in range(num)]


async def run_requests(client, model: str, requests: list[BenchRequest], args: argparse.Namespace, chat: bool):
    """All requests, sent at their arrival times, at most max_concurrency at once; (results, seconds)."""
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    extra = {"temperature": args.temperature}
    if args.top_p is not None:
        extra["top_p"] = args.top_p
    vllm_fields = {"ignore_eos": True} if args.ignore_eos else {}
    vllm_fields |= {k: getattr(args, k) for k in ("top_k", "min_p") if getattr(args, k) is not None}
    if vllm_fields:
        extra["extra_body"] = vllm_fields

    async def one(req: BenchRequest) -> RequestResult:
        prompt = req.prompt
        if chat and isinstance(prompt, list):
            prompt = args.tokenizer_obj.decode(prompt)
        if limit is None:
            return await stream_request(client, model, prompt, req.output_len, chat, **extra)
        async with limit:
            return await stream_request(client, model, prompt, req.output_len, chat, **extra)

    tasks = []
    start = time.perf_counter()
    for req, gap in zip(requests, arrival_gaps(len(requests), args.request_rate, args.burstiness, args.seed)):
        tasks.append(asyncio.create_task(one(req)))
        if gap:
            await asyncio.sleep(gap)
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


def summarize(
    results: list[RequestResult], duration: float, percentiles: list[float], percentile_metrics=METRICS
) -> dict:
    """vLLM's serving result fields: counts, throughputs, per metric mean / median / std in ms, and the
    percentiles (p<q>) of percentile_metrics."""
    done = [r for r in results if r.success]
    values = {
        "ttft": [r.ttft for r in done],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done],
    }
    input_tokens, output_tokens = sum(r.prompt_len for r in done), sum(r.output_tokens for r in done)
    out = {
        "duration": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    for name in METRICS:
        ms = [1000 * v for v in values[name]] or [0.0]
        out |= {f"mean_{name}_ms": statistics.fmean(ms), f"median_{name}_ms": statistics.median(ms)}
        out[f"std_{name}_ms"] = statistics.pstdev(ms)
        for q in percentiles if name in percentile_metrics else ():
            out[f"p{q:g}_{name}_ms"] = percentile(ms, q)
    out["errors"] = sorted({r.error for r in results if not r.success})[:5]
    return out


def _client_url(args: argparse.Namespace) -> tuple[str, bool]:
    """The openai client's base URL (root + the endpoint's /v1 part) and whether the endpoint is chat."""
    endpoint = args.endpoint or BACKENDS[args.backend]
    if endpoint not in ENDPOINTS:
        raise ValueError(f"--endpoint={endpoint!r} is not supported: one of {sorted(ENDPOINTS)}")
    root = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    chat = ENDPOINTS[endpoint]
    return root + endpoint.removesuffix("/chat/completions" if chat else "/completions"), chat


def _tokenizer(args: argparse.Namespace, card):
    """The tokenizer the dataset is made with: --tokenizer, else --model, else the served model's root or id."""
    from pagedllm.model_loader.resolve import resolve_model
    from pagedllm.tokenizer import get_tokenizer

    names = [args.tokenizer] if args.tokenizer else [args.model, getattr(card, "root", None), card.id]
    errors = []
    for name in dict.fromkeys(n for n in names if n):
        try:
            return name, get_tokenizer(resolve_model(name, tokenizer_only=True), None, args.trust_remote_code)
        except ValueError as e:
            errors.append(str(e))
    raise ValueError(f"no tokenizer for the dataset (pass --tokenizer: a directory, .gguf file or repo id): {errors}")


async def _benchmark(args: argparse.Namespace) -> dict:
    from openai import AsyncOpenAI

    url, chat = _client_url(args)
    api_key = None if os.environ.get("OPENAI_API_KEY") else "none"  # the openai client reads OPENAI_API_KEY
    client = AsyncOpenAI(base_url=url, api_key=api_key, max_retries=0, timeout=args.request_timeout)
    try:
        try:
            cards = (await client.models.list()).data
        except Exception as e:  # connection refused, 401: nothing to benchmark
            raise ValueError(f"no OpenAI-compatible server answers at {url}: {type(e).__name__}: {e}") from None
        model = args.served_model_name or args.model or cards[0].id
        tokenizer_id, args.tokenizer_obj = _tokenizer(args, cards[0])
        requests = sample_requests(args, len(args.tokenizer_obj), args.tokenizer_obj)
        results, duration = await run_requests(client, model, requests, args, chat)
    finally:
        await client.close()
    rate = "inf" if args.request_rate == float("inf") else args.request_rate
    info = {"date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": args.backend, "model_id": model}
    info |= {"tokenizer_id": tokenizer_id, "num_prompts": len(requests), "request_rate": rate}
    info |= {"burstiness": args.burstiness, "max_concurrency": args.max_concurrency}
    info |= ({"label": args.label} if args.label else {}) | dict(args.metadata or [])
    info |= summarize(results, duration, args.metric_percentiles, args.percentile_metrics)
    if args.save_detailed:  # per request, in the order sent
        info |= {"input_lens": [r.prompt_len for r in results], "output_lens": [r.output_tokens for r in results]}
        info |= {"ttfts": [r.ttft for r in results], "itls": [r.itl for r in results]}
        info["errors"] = [r.error for r in results]
    return info


def _serve(args: argparse.Namespace) -> int:
    """One run per --request-rate (one JSON line each); --plot draws them all."""
    rates = args.request_rate
    if not all(r > 0 for r in rates):
        raise ValueError(f"--request-rate={rates} must be positive (inf: all at once)")
    if not args.burstiness > 0:
        raise ValueError(f"--burstiness={args.burstiness} must be positive")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency={args.max_concurrency} must be at least 1")
    if args.plot:
        from pagedllm.benchmarks.plot import require_matplotlib

        require_matplotlib()  # before the runs, not after them
    results = []
    for rate in rates:
        args.request_rate = rate
        result = asyncio.run(_benchmark(args))
        print(json.dumps(result), flush=True)
        if args.save_result:
            _save(args, result, several=len(rates) > 1)
        results.append(result)
    if args.plot:
        from pagedllm.benchmarks.plot import plot_serving

        plot_serving(results, args.plot, args.label)
    return 0 if all(r["completed"] for r in results) else 1


def run_benchmark(argv: list[str]) -> dict:
    """One run of `pagedllm bench serve` with these flags (one --request-rate), not printed: its result fields."""
    parser = argparse.ArgumentParser(prog="pagedllm bench")
    add_serve_bench_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", *argv])
    if len(args.request_rate) != 1 or not args.request_rate[0] > 0:
        raise ValueError(f"--request-rate={args.request_rate}: one positive rate")
    args.request_rate = args.request_rate[0]
    return asyncio.run(_benchmark(args))


def _save(args: argparse.Namespace, result: dict, several: bool) -> None:
    name = args.result_filename or f"{args.backend}-{result['request_rate']}qps-{result['date']}.json"
    if args.result_filename and several:  # one file per rate: r.json -> r-4qps.json
        stem, dot, ext = name.rpartition(".")
        name = f"{stem}-{result['request_rate']}qps.{ext}" if dot else f"{name}-{result['request_rate']}qps"
    with open(os.path.join(args.result_dir or ".", name), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: KEY=VALUE")
    return key, value


def _metric_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or set(names) - set(METRICS):
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of {METRICS}")
    return names


def _float_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(0 <= v <= 100 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated percentiles between 0 and 100")
    return values


def add_serve_bench_parser(sub) -> None:
    p = sub.add_parser("serve", help="a running server under a stream of requests (vLLM's benchmark_serving)")
    p.add_argument("--backend", choices=sorted(BACKENDS), default="vllm")
    p.add_argument("--base-url", default=None, help="the server's root URL (default: http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default=None, help="/v1/completions (default) or /v1/chat/completions")
    p.add_argument("--model", default=None, help="the model (default: the server's first)")
    p.add_argument("--served-model-name", default=None, help="the name requests use (default: --model)")
    p.add_argument("--tokenizer", default=None, help="tokenizer of the dataset (default: the model's)")
    p.add_argument("--trust-remote-code", action="store_true")
    add_dataset_args(p, input_len=1024, output_len=128, num_prompts=1000)
    p.add_argument(
        "--request-rate",
        type=float,
        nargs="+",
        default=[float("inf")],
        help="requests per second (inf: at once); several rates: one run each",
    )
    p.add_argument("--plot", default=None, metavar="PNG", help="plot latency and throughput against request rate")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals (1: Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--ignore-eos", action="store_true", help="every request makes its full output length")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--percentile-metrics", type=_metric_list, default=["ttft", "tpot", "itl"])
    p.add_argument("--metric-percentiles", type=_float_list, default=[99.0], help="e.g. 50,90,99")
    p.add_argument("--request-timeout", type=float, default=3600.0, help="seconds one request may take")
    p.add_argument("--save-result", action="store_true", help="also write the result to a JSON file")
    p.add_argument("--save-detailed", action="store_true", help="with per-request lengths, TTFTs, ITLs and errors")
    p.add_argument("--label", default=None, help="a name for this run, in the result")
    p.add_argument(
        "--metadata", nargs="*", type=_key_value, default=None, metavar="KEY=VALUE", help="kept in the result"
    )
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
    p.set_defaults(func=_serve)
