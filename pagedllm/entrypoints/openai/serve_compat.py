"""vLLM server flags that pagedllm accepts for compatibility (its engine flags are in engine_compat): each is a
no-op where pagedllm's design makes it moot, or supported only at its default (another value is an error naming
why). The README's table is written from SERVE_COMPAT."""

from __future__ import annotations

import argparse
import json
from typing import Any

_SWITCH: dict[str, Any] = {"action": "store_true"}
_TEXT: dict[str, Any] = {"default": None}
_ONE_PROCESS = "the server and its engine run in one process"

# flag name -> (kind, argparse keywords, why); kind "no-op": any value, "only": the default only
SERVE_COMPAT: dict[str, tuple[str, dict[str, Any], str]] = {
    "disable_frontend_multiprocessing": ("no-op", _SWITCH, _ONE_PROCESS),
    "enable_reasoning": ("no-op", _SWITCH, "--reasoning-parser alone turns reasoning on"),
    "enable_offline_docs": ("no-op", _SWITCH, "no documentation pages are served (only /openapi.json)"),
    "enable_log_deltas": ("no-op", {"action": argparse.BooleanOptionalAction, "default": True}, "no output logs"),
    "headless": ("only", _SWITCH, "no multi-node data parallelism: the server runs its engine itself"),
    "api_server_count": ("only", {"type": int, "default": 1}, _ONE_PROCESS),
    "prompt_adapters": ("only", {"nargs": "+", "default": None}, "no prompt adapters (LoRA: --lora-modules)"),
    "middleware": ("only", {"action": "append", "default": None}, "no ASGI middleware is imported by name"),
    "tool_parser_plugin": ("only", _TEXT, "no tool-parser plugins: the built-in --tool-call-parser choices"),
    "tool_server": ("only", _TEXT, "no built-in tool servers (tools run in the client)"),
    "trust_request_chat_template": ("only", _SWITCH, "a request may not bring its own chat template"),
    "exclude_tools_when_tool_choice_none": ("only", _SWITCH, 'tools stay in the prompt with tool_choice "none"'),
    "enable_tokenizer_info_endpoint": ("only", _SWITCH, "no /tokenizer_info endpoint (/tokenize, /detokenize are)"),
    "enable_log_outputs": ("only", _SWITCH, "request logs show the inputs, not the outputs"),
    "log_error_stack": ("only", _SWITCH, "error responses are logged without stack traces"),
    "tokens_only": ("only", _SWITCH, "every endpoint is served"),
    "disable_access_log_for_endpoints": ("only", _TEXT, "the access log is all or nothing"),
    "enable_ssl_refresh": ("only", _SWITCH, "TLS certificates are read once, at start"),
    "h11_max_header_count": ("only", {"type": int, "default": 256}, "h11 limits headers by size only"),
}


def add_serve_compat_flags(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("vLLM compatibility", "vLLM's server flags with no effect or one value here")
    for name, (_, kwargs, why) in SERVE_COMPAT.items():
        group.add_argument("--" + name.replace("_", "-"), dest=name, help=why, **kwargs)


def check_serve_compat(args: argparse.Namespace) -> None:
    """ValueError for a compatibility flag given a value pagedllm does not support."""
    for name, (kind, kwargs, why) in SERVE_COMPAT.items():
        value = getattr(args, name, None)
        default = kwargs.get("default", False if kwargs.get("action") == "store_true" else None)
        if kind == "only" and value != default:
            raise ValueError(f"--{name.replace('_', '-')}={value!r} is not supported: {why}")


def json_object(text: str) -> dict:
    """A flag's JSON object, e.g. --default-chat-template-kwargs '{"enable_thinking": false}'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value
