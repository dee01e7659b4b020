"""`pagedllm serve` under N concurrent streaming clients (default N = 1, 8, 32). One JSON line per N (appended to
benchmarks/results.jsonl unless --no-append):

  serve-stream-<N>   output tokens per second over the whole run, requests per second, time to first token and
                     inter-token latency (gaps between streamed chunks) p50 / p99 in ms

Each client sends its requests one after another through the official openai client (AsyncOpenAI, /v1/completions,
stream=True). Requests draw from a fixed mix (seeded): prompts of --prompt-lens random token ids, exactly
--output-lens new tokens each (ignore_eos), so every run does the same work. The script starts the server itself
(a subprocess on 127.0.0.1) unless --url points at a running one.

    python benchmarks/serve_bench.py                                  # the bundled model on this CPU
    python benchmarks/serve_bench.py --server-args "--dtype float32" --clients 1,8
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shlex
import socket
import subprocess
import sys
import time
import urllib.request

from pagedllm.benchmarks.offline import percentile
from pagedllm.benchmarks.serve import stream_request

try:
    from benchmarks.common import REPO_ROOT, emit, git_commit, machine_description, make_record, rounded
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    from common import REPO_ROOT, emit, git_commit, machine_description, make_record, rounded

IGNORE_EOS = {"ignore_eos": True}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--model", default=None, help="model for the started server (default: the bundled SmolLM2)")
    p.add_argument("--server-args", default="", help="more `pagedllm serve` flags for the started server")
    p.add_argument("--clients", default="1,8,32", help="comma-separated numbers of concurrent clients")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--prompt-lens", default="32,128,512", help="prompt lengths (tokens) drawn from")
    p.add_argument("--output-lens", default="16,32,64", help="output lengths (tokens) drawn from")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-append", action="store_true")
    return p.parse_args(argv)


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "pagedllm", "serve", *([args.model] if args.model else [])]
    cmd += ["--port", str(port), "--uvicorn-log-level", "warning", *shlex.split(args.server_args)]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start within 600 s")


async def run_clients(url: str, num_clients: int, mix: list[tuple[list[int], int]], per_client: int) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    model = (await client.models.list()).data[0].id
    stats = {"ttft": [], "itl": [], "tokens": 0}

    async def worker(c: int) -> None:
        for r in range(per_client):
            prompt, max_tokens = mix[(c * per_client + r) % len(mix)]
            result = await stream_request(client, model, prompt, max_tokens, temperature=0, extra_body=IGNORE_EOS)
            if not result.success:
                raise RuntimeError(f"a request failed: {result.error}")
            stats["ttft"].append(result.ttft)
            stats["itl"].extend(result.itl)
            stats["tokens"] += result.output_tokens

    start = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in range(num_clients)))
    stats["seconds"] = time.perf_counter() - start
    await client.close()
    return stats


def build_mix(args: argparse.Namespace, size: int = 64) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    prompt_lens = [int(x) for x in args.prompt_lens.split(",")]
    output_lens = [int(x) for x in args.output_lens.split(",")]
    # token ids clear of the special tokens at the start of most vocabularies, inside any vocabulary we serve
    return [
        ([rng.randrange(1000, 30000) for _ in range(rng.choice(prompt_lens))], rng.choice(output_lens))
        for _ in range(size)
    ]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    proc, url = (None, args.url) if args.url else start_server(args)
    machine, commit = machine_description(), git_commit()
    mix = build_mix(args)
    try:
        asyncio.run(run_clients(url, 1, mix[:1], 1))  # warm-up
        for num_clients in [int(x) for x in args.clients.split(",")]:
            s = asyncio.run(run_clients(url, num_clients, mix, args.requests_per_client))
            ms = {f"{name}_{q}_ms": rounded(1000 * (percentile(s[name], q) or 0), 1) for name in ("ttft", "itl")
                  for q in (50, 99)}  # fmt: skip
            record = make_record(
                f"serve-stream-{num_clients}",
                machine,
                commit,
                clients=num_clients,
                requests=num_clients * args.requests_per_client,
                output_tokens=s["tokens"],
                seconds=rounded(s["seconds"], 2),
                output_tok_s=rounded(s["tokens"] / s["seconds"], 1),
                **ms,
                prompt_lens=args.prompt_lens,
                output_lens=args.output_lens,
                server_args=args.server_args,
            )
            emit(record, append=not args.no_append)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)


if __name__ == "__main__":
    main()
