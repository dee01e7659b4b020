"""`pagedllm serve [MODEL] [options]`: the server's flags and the engine's (LLM's arguments, vLLM's flag names).

Only argparse lives here, so `pagedllm --help` works without the `serve` extra; the server is imported when the
command runs."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pagedllm.entrypoints.openai.limits import (
    DEFAULT_MAX_BAD_WORDS,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_LOGPROBS,
    DEFAULT_MAX_N,
    DEFAULT_MAX_PROMPTS,
    DEFAULT_MAX_STOP,
    DEFAULT_MAX_WORD_CHARS,
)


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None


_BOOL = "bool"
# LLM argument -> flag type; each becomes --flag-name (absent flags keep LLM's defaults)
ENGINE_FLAGS: dict[str, Any] = {
    "tokenizer": str,
    "revision": str,
    "dtype": str,
    "seed": int,
    "max_model_len": int,
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "block_size": int,
    "gpu_memory_utilization": float,
    "enforce_eager": _BOOL,
    "async_scheduling": _BOOL,
    "tensor_parallel_size": int,
    "pipeline_parallel_size": int,
    "distributed_executor_backend": str,
    "data_parallel_size": int,
    "trust_remote_code": _BOOL,
    "hf_overrides": _json,
    "rope_scaling": _json,
    "rope_theta": float,
    "load_format": str,
    "quantization": str,
    "num_gpu_blocks_override": int,
    "kv_cache_memory_bytes": int,
    "kv_cache_dtype": str,
    "enable_prefix_caching": _BOOL,
    "compilation_config": _json,
    "device": str,
    "generation_config": str,
    "attention_backend": str,
    "task": str,
    "runner": str,
    "convert": str,
    "pooler_config": _json,
    "model_impl": str,
    "speculative_config": _json,
    "enable_lora": _BOOL,
    "max_loras": int,
    "max_lora_rank": int,
    "max_cpu_loras": int,
    "lora_dtype": str,
    "guided_decoding_backend": str,
}
ENGINE_FLAG_SHORT = {"tensor_parallel_size": "-tp", "pipeline_parallel_size": "-pp", "data_parallel_size": "-dp"}


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine", "the arguments of LLM(...); omitted ones keep LLM's defaults")
    for name, kind in ENGINE_FLAGS.items():
        flags = ["--" + name.replace("_", "-"), *filter(None, [ENGINE_FLAG_SHORT.get(name)])]
        if kind is _BOOL:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS)
        else:
            group.add_argument(*flags, dest=name, type=kind, default=argparse.SUPPRESS)


def add_serve_parser(sub: Any) -> None:
    serve = sub.add_parser(
        "serve",
        help="run an OpenAI-compatible HTTP server",
        description="An OpenAI-compatible server: /v1/completions, /v1/chat/completions, /v1/embeddings "
        "(--task embed), /v1/models, /tokenize, /detokenize, /health, /version, /metrics.",
    )
    serve.add_argument("model", nargs="?", default=None, help="model directory, .gguf file or cached repo id")
    serve.add_argument("--model", dest="model_flag", default=None, help="the same as the positional MODEL")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (not on /health, /metrics); default: $PAGEDLLM_API_KEY, else "
        "$VLLM_API_KEY, else no key",
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
    serve.add_argument("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    _add_engine_flags(serve)
    serve.set_defaults(func=_serve)


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


def _serve(args: argparse.Namespace) -> int:
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    if args.model is not None and args.model_flag is not None and args.model != args.model_flag:
        raise ValueError(f"MODEL {args.model!r} and --model {args.model_flag!r} differ: give one")
    args.model = args.model or args.model_flag
    engine_kwargs = {name: getattr(args, name) for name in ENGINE_FLAGS if hasattr(args, name)}
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
