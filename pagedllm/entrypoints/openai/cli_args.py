"""`pagedllm serve [MODEL] [options]`: the server's flags, and the engine's from EngineArgs.add_cli_args (vLLM's
flag names; the one definition of the engine's options).

Only argparse lives here, so `pagedllm --help` works without the `serve` extra; the server is imported when the
command runs."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pagedllm.engine_args import EngineArgs
from pagedllm.entrypoints.openai.limits import (
    DEFAULT_MAX_BAD_WORDS,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_LOGPROBS,
    DEFAULT_MAX_N,
    DEFAULT_MAX_PROMPTS,
    DEFAULT_MAX_STOP,
    DEFAULT_MAX_WORD_CHARS,
)
from pagedllm.entrypoints.openai.serve_compat import add_serve_compat_flags, check_serve_compat, json_object


def add_serve_parser(sub: Any) -> None:
    serve = sub.add_parser(
        "serve",
        help="run an OpenAI-compatible HTTP server",
        description="An OpenAI-compatible server: /v1/completions, /v1/chat/completions, /v1/embeddings "
        "(--task embed), /v1/score, /v1/rerank, /pooling (pooling models), /generate, /v1/models, /tokenize, "
        "/detokenize, /health, /version, /metrics.",
    )
    serve.add_argument("model", nargs="?", default=None, help="model directory, .gguf file or cached repo id")
    serve.add_argument("--model", dest="model_flag", default=None, help="the same as the positional MODEL")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key",
        nargs="+",
        default=None,
        help="require 'Authorization: Bearer KEY' (not on /health, /metrics); several keys: any one of them "
        "(rotation); default: $PAGEDLLM_API_KEY, else $VLLM_API_KEY, else no key",
    )
    serve.add_argument("--served-model-name", nargs="+", default=None, help="names clients use (default: MODEL)")
    serve.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters served as models of their own (with --enable-lora): name=path, or JSON "
        '{"name": ..., "path": ...}',
    )
    serve.add_argument("--chat-template", default=None, help="a Jinja chat template or its file (default: the model's)")
    serve.add_argument("--chat-template-content-format", default="auto", choices=["auto", "string", "openai"])
    serve.add_argument(
        "--default-chat-template-kwargs",
        type=json_object,
        default=None,
        help="chat_template_kwargs every chat request starts from (JSON, e.g. '{\"enable_thinking\": false}'); "
        "a request's own keys win",
    )
    _add_response_flags(serve)
    _add_tool_flags(serve)
    limits = serve.add_argument_group("limits", "requests beyond these get HTTP 400")
    limits.add_argument("--max-n", type=int, default=DEFAULT_MAX_N, help="largest n / best_of (default: %(default)s)")
    limits.add_argument(
        "--max-prompts",
        type=int,
        default=DEFAULT_MAX_PROMPTS,
        help="most prompts in one completions call or inputs in one embeddings call (default: %(default)s)",
    )
    limits.add_argument(
        "--max-logprobs", type=int, default=DEFAULT_MAX_LOGPROBS, help="largest logprobs / top_logprobs (default: 20)"
    )
    limits.add_argument(
        "--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="largest request body (default: 16 MiB)"
    )
    limits.add_argument(
        "--max-stop", type=int, default=DEFAULT_MAX_STOP, help="most stop strings in a request (default: %(default)s)"
    )
    limits.add_argument(
        "--max-bad-words",
        type=int,
        default=DEFAULT_MAX_BAD_WORDS,
        help="most bad_words in a request (default: %(default)s)",
    )
    limits.add_argument(
        "--max-word-chars",
        type=int,
        default=DEFAULT_MAX_WORD_CHARS,
        help="longest stop string or bad word, in characters (default: %(default)s)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=int,
        default=30,
        help="on SIGTERM, seconds in-flight requests may take to finish before they are cut (default: 30)",
    )
    _add_http_flags(serve)
    serve.add_argument(
        "--metrics-prefix",
        action="append",
        default=[],
        help="also show every /metrics family under this prefix (e.g. pagedllm), beside vLLM's `vllm:` names",
    )
    serve.add_argument(
        "--max-log-len", type=int, default=None, help="most prompt characters / token ids a request log line shows"
    )
    serve.add_argument("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    EngineArgs.add_cli_args(serve)
    add_serve_compat_flags(serve)
    serve.set_defaults(func=_serve)


def _add_response_flags(serve: argparse.ArgumentParser) -> None:
    out = serve.add_argument_group("responses and logs (vLLM's flags)")
    out.add_argument("--response-role", default="assistant", help="the reply's role with add_generation_prompt")
    out.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help='logprobs name tokens as "token_id:N" unless a request sets return_tokens_as_token_ids',
    )
    out.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="streams end with a usage chunk even without stream_options.include_usage",
    )
    out.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage.prompt_tokens_details.cached_tokens (always reported here; accepted for vLLM's launch lines)",
    )
    out.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log each request (the default here; --disable-log-requests turns it off)",
    )
    out.add_argument("--disable-uvicorn-access-log", action="store_true", help="no access log, even at debug level")
    out.add_argument("--enable-server-load-tracking", action="store_true", help="GET /load: the requests in flight")
    out.add_argument(
        "--enable-request-id-headers", action="store_true", help="X-Request-Id on every response (the client's or new)"
    )
    out.add_argument("--disable-fastapi-docs", action="store_true", help="no /openapi.json (/docs is never served)")
    out.add_argument(
        "--log-config-file",
        default=None,
        help="a JSON logging dictConfig for pagedllm's and uvicorn's logs (default: $VLLM_LOGGING_CONFIG_PATH)",
    )


def _add_tool_flags(serve: argparse.ArgumentParser) -> None:
    from pagedllm.reasoning import REASONING_PARSERS
    from pagedllm.tool_parsers import TOOL_PARSER_NAMES

    tools = serve.add_argument_group("tool calling and reasoning")
    tools.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='answer tool_choice "auto" (the default with tools) by reading tool calls from the reply; needs '
        "--tool-call-parser",
    )
    tools.add_argument(
        "--tool-call-parser", choices=TOOL_PARSER_NAMES, default=None, help="the model's tool-call format"
    )
    tools.add_argument(
        "--reasoning-parser",
        choices=tuple(REASONING_PARSERS),
        default=None,
        help="put the reply's <think>...</think> in reasoning_content; structured outputs start after it",
    )


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError("must be a JSON list of strings, e.g. '[\"*\"]'")
    return value


def _add_http_flags(serve: argparse.ArgumentParser) -> None:
    """vLLM's CORS, SSL and root-path flags, with vLLM's defaults."""
    http = serve.add_argument_group("http", "CORS, TLS and proxy settings (vLLM's flags and defaults)")
    http.add_argument("--allowed-origins", type=_json_list, default=["*"], help='CORS origins (JSON; default ["*"])')
    http.add_argument("--allowed-methods", type=_json_list, default=["*"], help="CORS methods (JSON)")
    http.add_argument("--allowed-headers", type=_json_list, default=["*"], help="CORS headers (JSON)")
    http.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    http.add_argument("--root-path", default=None, help="the path prefix a proxy serves this app under")
    http.add_argument("--ssl-keyfile", default=None, help="TLS private key file (with --ssl-certfile: HTTPS)")
    http.add_argument("--ssl-certfile", default=None, help="TLS certificate file")
    http.add_argument("--ssl-ca-certs", default=None, help="CA certificates to verify clients with")
    http.add_argument("--ssl-cert-reqs", type=int, default=0, help="client certificate: 0 none, 1 optional, 2 required")
    http.add_argument("--ssl-ciphers", default=None, help="TLS cipher suites (TLS 1.2 and below), OpenSSL's syntax")
    http.add_argument("--uds", default=None, help="listen on this Unix domain socket instead of --host / --port")
    http.add_argument(
        "--h11-max-incomplete-event-size",
        type=int,
        default=4 << 20,
        help="largest incomplete HTTP event (header block or body part) in bytes (default: 4 MiB)",
    )


def _serve(args: argparse.Namespace) -> int:
    check_serve_compat(args)
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    if args.model is not None and args.model_flag is not None and args.model != args.model_flag:
        raise ValueError(f"MODEL {args.model!r} and --model {args.model_flag!r} differ: give one")
    args.model = args.model or args.model_flag
    engine_kwargs = EngineArgs.cli_kwargs(args)
    if args.enable_log_requests and engine_kwargs.get("disable_log_requests"):
        raise ValueError("--enable-log-requests and --disable-log-requests contradict each other: give one")
    if engine_kwargs.get("data_parallel_size", 1) != 1:
        raise ValueError(
            f"--data-parallel-size={engine_kwargs['data_parallel_size']}: the server runs one engine (allowed: 1); "
            "data parallelism splits the prompts of offline LLM(...).generate calls"
        )
    try:
        from pagedllm.entrypoints.openai.launcher import run_server
    except ImportError as e:
        raise ValueError(f"`pagedllm serve` needs the serve extra (pip install 'pagedllm[serve]'): {e}") from None
    return run_server(args, engine_kwargs)
