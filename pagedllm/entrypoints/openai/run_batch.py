"""`pagedllm run-batch -i in.jsonl -o out.jsonl [MODEL] [engine flags]`: OpenAI's batch file format, as
`vllm run-batch`.

Each input line is {"custom_id", "method": "POST", "url", "body"} for /v1/completions, /v1/chat/completions,
/v1/embeddings, /v1/score or /v1/rerank; each output line is {"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}. The requests run through the server's own app (in process, no socket), so a body is
checked exactly as the server checks it, and the engine batches them. A line is written (and flushed) as soon as
its request finishes, so the output grows while the batch runs. Resumable: a re-run with the same output file
skips the custom_ids already in it (a line cut short by a kill is dropped and redone), so after a kill and a re-run
every request is in the output exactly once."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import uuid
from typing import Any

from pagedllm.engine_args import EngineArgs

URLS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/score", "/v1/rerank")
DEFAULT_MAX_CONCURRENCY = 256


def read_requests(path: str) -> list[dict]:
    """The input lines, checked: each an object with a unique str custom_id, method POST and a supported url."""
    requests, seen = [], set()
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON line: {e}") from None
            if not isinstance(item, dict) or not isinstance(item.get("custom_id"), str):
                raise ValueError(f"{path}:{n}: each line needs a string custom_id")
            if item["custom_id"] in seen:
                raise ValueError(f"{path}:{n}: custom_id {item['custom_id']!r} is used twice (ids must be unique)")
            if item.get("method", "POST") != "POST" or item.get("url") not in URLS:
                raise ValueError(f"{path}:{n}: method must be POST and url one of {URLS}, got {item.get('url')!r}")
            if not isinstance(item.get("body"), dict):
                raise ValueError(f"{path}:{n}: body must be a JSON object")
            seen.add(item["custom_id"])
            requests.append(item)
    return requests


def done_ids(path: str) -> set[str]:
    """custom_ids already answered in the output file; a last line cut short (a kill mid-write) is cut off."""
    if not os.path.exists(path):
        return set()
    with open(path, "rb") as f:
        data = f.read()
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) != len(data):
        with open(path, "r+b") as f:
            f.truncate(len(complete))
    return {json.loads(line)["custom_id"] for line in complete.splitlines() if line.strip()}


async def call_app(app, path: str, body: dict) -> tuple[int, Any]:
    """POSTs body to the ASGI app in process; (status, parsed JSON body)."""
    data = json.dumps(body).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
    }  # fmt: skip
    sent = False
    status, chunks = 500, []

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}
        await asyncio.Event().wait()  # the client never goes away
        return {}

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    text = b"".join(chunks)
    return status, json.loads(text) if text else None


def output_line(item: dict, status: int, body: Any) -> dict:
    error = body.get("error") if status != 200 and isinstance(body, dict) else None
    response = {"status_code": status, "request_id": f"pagedllm-batch-{uuid.uuid4().hex}"}
    response["body"] = body if status == 200 else None
    return {"id": f"pagedllm-{uuid.uuid4().hex}", "custom_id": item["custom_id"], "response": response, "error": error}


async def run_requests(app, requests: list[dict], out, max_concurrency: int) -> int:
    """Runs the requests (at most max_concurrency at once), writing each line as it finishes; the number of
    requests that failed."""
    slots = asyncio.Semaphore(max_concurrency)
    failed = 0

    async def one(item: dict) -> None:
        nonlocal failed
        async with slots:
            body = item["body"]
            if body.get("stream"):
                status, answer = 400, {"error": {"message": "stream is not supported in a batch", "param": "stream"}}
            else:
                status, answer = await call_app(app, item["url"], body)
        failed += status != 200
        out.write(json.dumps(output_line(item, status, answer), ensure_ascii=False) + "\n")
        out.flush()

    await asyncio.gather(*(one(item) for item in requests))
    return failed


def _run_batch(args: argparse.Namespace) -> int:
    from pagedllm import LLM
    from pagedllm.entrypoints.openai.api_server import build_app
    from pagedllm.entrypoints.openai.async_engine import AsyncEngine
    from pagedllm.entrypoints.openai.launcher import served_names
    from pagedllm.entrypoints.openai.serving_utils import ServerState

    if args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency={args.max_concurrency} must be at least 1")
    requests = read_requests(args.input_file)
    finished = done_ids(args.output_file)
    todo = [item for item in requests if item["custom_id"] not in finished]
    print(f"pagedllm run-batch: {len(requests)} requests, {len(requests) - len(todo)} already done", file=sys.stderr)
    if not todo:
        return 0
    llm = LLM(args.model, **EngineArgs.cli_kwargs(args))
    engine = AsyncEngine(llm)
    names = served_names(args.model, args.served_model_name, llm.llm_engine.config.model.model_path)
    app = build_app(ServerState(engine, names))
    engine.start()
    try:
        with open(args.output_file, "a", encoding="utf-8") as out:
            failed = asyncio.run(run_requests(app, todo, out, args.max_concurrency))
    finally:
        engine.stop()
    print(f"pagedllm run-batch: {len(todo)} requests run, {failed} failed", file=sys.stderr)
    return 0


def add_run_batch_parser(sub: Any) -> None:
    parser = sub.add_parser("run-batch", help="run a file of OpenAI batch requests (resumable)")
    parser.add_argument("model", nargs="?", default=None, help="model directory, .gguf file or cached repo id")
    parser.add_argument("--model", dest="model_flag", default=None, help="the same as the positional MODEL")
    parser.add_argument("-i", "--input-file", required=True, help="OpenAI batch input (.jsonl)")
    parser.add_argument("-o", "--output-file", required=True, help="results (.jsonl); a re-run skips what it holds")
    parser.add_argument("--served-model-name", nargs="+", default=None, help="names the bodies' `model` may use")
    parser.add_argument(
        "--max-concurrency", type=int, default=DEFAULT_MAX_CONCURRENCY, help="requests in flight at once"
    )
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if args.model is not None and args.model_flag is not None and args.model != args.model_flag:
        raise ValueError(f"MODEL {args.model!r} and --model {args.model_flag!r} differ: give one")
    args.model = args.model or args.model_flag
    return _run_batch(args)


if __name__ == "__main__":  # as `pagedllm run-batch`
    from pagedllm.cli import main

    sys.exit(main(["run-batch", *sys.argv[1:]]))
