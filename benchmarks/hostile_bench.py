"""A canary request's latency through `pagedllm serve` while hostile requests are being handled or refused, against
the canary alone in the same run. One JSON line per case (appended to benchmarks/results.jsonl unless --no-append):

  hostile-bad-words   48,000 bad_words (~470 KB)
  hostile-big-prompt  a 6.5 MB prompt, refused as longer than the context once tokenized
  hostile-stop        4,000 stop strings of 1,000 characters each

Each of --repeats rounds sends one hostile request and, while it is being handled or refused, the canary (a short
greedy completion of --canary-tokens tokens, non-streaming); the figure is the canary's median latency so over its
median alone, measured in the same run (goal: <= 1.5). The hostile request's own latency and status are reported.
The script starts the server itself (a subprocess on 127.0.0.1, the bundled model unless --model) unless --url
points at a running one.

    python benchmarks/hostile_bench.py
    python benchmarks/hostile_bench.py --server-args "--dtype float32" --repeats 10
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import string
import threading
import time
import urllib.parse

try:
    from benchmarks.common import emit, git_commit, machine_description, make_record, rounded
    from benchmarks.serve_bench import start_server
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    from common import emit, git_commit, machine_description, make_record, rounded
    from serve_bench import start_server


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--model", default=None, help="model for the started server (default: the bundled SmolLM2)")
    p.add_argument("--server-args", default="--dtype float32", help="more `pagedllm serve` flags")
    p.add_argument("--repeats", type=int, default=8, help="canary requests per measurement")
    p.add_argument("--canary-tokens", type=int, default=16)
    p.add_argument("--cases", default="bad-words,big-prompt,stop")
    p.add_argument("--no-append", action="store_true")
    return p.parse_args(argv)


def _words(count: int, length: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choices(string.ascii_lowercase, k=length)) for _ in range(count)]


def hostile_bodies() -> dict[str, dict]:
    base = {"prompt": "Hello", "max_tokens": 4}
    return {
        "bad-words": {**base, "bad_words": _words(48_000, 9, 1)},
        "big-prompt": {**base, "prompt": "lorem ipsum " * (6_500_000 // 12)},
        "stop": {**base, "stop": _words(4_000, 1_000, 2)},
    }


def post(url: str, body: bytes, timeout: float = 600) -> tuple[int, float]:
    """(status, seconds) of one POST /v1/completions."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    start = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        return resp.status, time.perf_counter() - start
    finally:
        conn.close()


def _canary(url: str, body: bytes) -> float:
    status, seconds = post(url, body)
    if status != 200:
        raise SystemExit(f"the canary got HTTP {status}")
    return seconds


def measure(url: str, canary: bytes, hostile: bytes, repeats: int) -> dict:
    """Rounds of: the canary alone, then the canary while one hostile request is in flight (alternated, so that
    the load of the machine drifts alike on both); medians in ms and the hostile requests' statuses."""
    alone, loaded, hostile_times = [], [], []
    statuses: dict[int, int] = {}
    for _ in range(repeats):
        alone.append(_canary(url, canary))
        result: list = []
        thread = threading.Thread(target=lambda out=result: out.append(post(url, hostile)))
        thread.start()
        time.sleep(0.05)  # the hostile request is in
        loaded.append(_canary(url, canary))
        thread.join(600)
        status, seconds = result[0]
        statuses[status] = statuses.get(status, 0) + 1
        hostile_times.append(seconds)
    ms = {
        name: 1000 * statistics.median(v)
        for name, v in (("alone", alone), ("loaded", loaded), ("hostile", hostile_times))
    }
    return {**ms, "statuses": statuses}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    proc, url = (None, args.url) if args.url else start_server(args)
    machine, commit = machine_description(), git_commit()
    canary = {"prompt": "The capital of France is", "max_tokens": args.canary_tokens, "temperature": 0}
    canary_body = json.dumps({**canary, "ignore_eos": True}).encode()
    bodies = hostile_bodies()
    try:
        _canary(url, canary_body)  # warm-up
        for case in args.cases.split(","):
            hostile = json.dumps(bodies[case]).encode()
            m = measure(url, canary_body, hostile, args.repeats)
            record = make_record(
                f"hostile-{case}",
                machine,
                commit,
                canary_alone_ms=rounded(m["alone"], 1),
                canary_under_load_ms=rounded(m["loaded"], 1),
                ratio=rounded(m["loaded"] / m["alone"], 2),
                hostile_bytes=len(hostile),
                hostile_ms=rounded(m["hostile"], 1),
                hostile_statuses={str(k): v for k, v in sorted(m["statuses"].items())},
                repeats=args.repeats,
                canary_tokens=args.canary_tokens,
                server_args=args.server_args,
            )
            emit(record, append=not args.no_append)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)


if __name__ == "__main__":
    main()
