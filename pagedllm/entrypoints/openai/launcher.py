"""Running the app under uvicorn: SIGTERM or Ctrl-C stops accepting, lets in-flight requests finish for
--shutdown-timeout seconds, then the process exits 0 (no re-raised signal, no KeyboardInterrupt traceback).

A client that half-closes its socket after sending a complete request (shutdown(SHUT_WR): "nothing more from me")
still gets its answer; only a reset connection counts as gone before the answer is written."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedllm import envs
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.async_engine import AsyncEngine
from pagedllm.entrypoints.openai.limits import ServerLimits
from pagedllm.entrypoints.openai.server_logging import RequestLogger, start_stats_thread
from pagedllm.entrypoints.openai.serving_utils import ServerState


def resolve_api_key(flag: str | list[str] | None, environ: Mapping[str, str] | None = None) -> str | list[str] | None:
    """--api-key (one key or several, any of which is accepted), else $PAGEDLLM_API_KEY, else $VLLM_API_KEY
    (envs), else None (no key required)."""
    return flag or envs.api_key(environ)


class HalfCloseProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, except that end-of-input after a complete request keeps the connection open
    for the answer (then closes it), instead of dropping the request as a disconnect."""

    def eof_received(self) -> bool | None:
        cycle = self.cycle
        if cycle is not None and not cycle.more_body and not cycle.response_complete:
            cycle.keep_alive = False  # nothing more can come on this connection: close it after the answer
            return True  # keep the transport open for writing
        return None


class _Server(uvicorn.Server):
    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        # uvicorn re-raises the signals it caught once it has shut down (exit status -15, a KeyboardInterrupt
        # traceback for SIGINT); a drained server has done what the signal asked, so it exits normally instead
        self._captured_signals.clear()


def lora_modules(llm, specs: list[str] | None, names: list[str]) -> dict:
    """--lora-modules name=path (or JSON {"name", "path"}): each adapter read and checked now, ids from 1."""
    from pagedllm.lora.request import LoRARequest

    out: dict = {}
    if specs and llm.llm_engine.config.lora is None:
        raise ValueError("--lora-modules needs --enable-lora")
    for spec in specs or []:
        if spec.lstrip().startswith("{"):
            fields = json.loads(spec)
            name, path = fields.get("name"), fields.get("path")
        else:
            name, _, path = spec.partition("=")
        if not name or not path:
            raise ValueError(f'--lora-modules {spec!r}: give name=path or {{"name": ..., "path": ...}}')
        if name in out or name in names:
            raise ValueError(f"--lora-modules {spec!r}: the name {name!r} is already served")
        out[name] = LoRARequest(name, len(out) + 1, path)
        llm.llm_engine.add_lora(out[name])  # a bad adapter stops the start, naming it
    return out


def served_names(model: str | None, given: list[str] | None, model_path: str) -> list[str]:
    if given:
        return list(given)
    if model:
        return [model]
    return [os.path.basename(model_path).removesuffix(".gguf")]


def run_server(args: Any, engine_kwargs: dict) -> int:
    from pagedllm import LLM
    from pagedllm.entrypoints.chat_template import load_chat_template

    limits = ServerLimits(
        args.max_n,
        args.max_prompts,
        args.max_logprobs,
        args.max_body_bytes,
        args.max_stop,
        args.max_bad_words,
        args.max_word_chars,
    )
    template = load_chat_template(args.chat_template) if args.chat_template else None
    if args.log_config_file:
        from pagedllm.logger import apply_config_file

        apply_config_file(args.log_config_file)  # pagedllm's loggers; uvicorn's read it too (log_config)
    llm = LLM(args.model, **engine_kwargs)
    engine = AsyncEngine(llm)
    if not llm.engine_args.disable_log_requests:
        engine.request_logger = RequestLogger(args.max_log_len)
    stop_stats = None
    if not llm.engine_args.disable_log_stats and engine.generates:
        stop_stats = start_stats_thread(engine.engine, envs.log_stats_interval())
    names = served_names(args.model, args.served_model_name, llm.llm_engine.config.model.model_path)
    loras = lora_modules(llm, getattr(args, "lora_modules", None), names)
    state = ServerState(engine, names, limits, template, args.chat_template_content_format, lora_modules=loras)
    state.tool_parser, state.enable_auto_tools = args.tool_call_parser, args.enable_auto_tool_choice
    if args.reasoning_parser:
        from pagedllm.reasoning import get_reasoning_parser, reasoning_markers

        state.reasoning_parser = args.reasoning_parser
        markers = reasoning_markers(get_reasoning_parser(args.reasoning_parser), llm.get_tokenizer())
        llm.llm_engine.reasoning_markers = markers  # a structured output's grammar starts after the reasoning
    state.metrics_prefixes = tuple(args.metrics_prefix)
    state.response_role, state.return_tokens_as_token_ids = args.response_role, args.return_tokens_as_token_ids
    state.force_include_usage = args.enable_force_include_usage
    state.default_chat_template_kwargs = args.default_chat_template_kwargs or {}
    cors = dict(
        allow_origins=args.allowed_origins,
        allow_methods=args.allowed_methods,
        allow_headers=args.allowed_headers,
        allow_credentials=args.allow_credentials,
    )
    app = build_app(
        state,
        resolve_api_key(args.api_key),
        cors,
        openapi=not args.disable_fastapi_docs,
        request_id_headers=args.enable_request_id_headers,
        track_load=args.enable_server_load_tracking,
    )
    engine.start()
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        http=HalfCloseProtocol,
        log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,
        timeout_keep_alive=envs.http_timeout_keep_alive(),
        access_log=args.uvicorn_log_level == "debug" and not args.disable_uvicorn_access_log,
        root_path=args.root_path or "",
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
        **({"ssl_ciphers": args.ssl_ciphers} if args.ssl_ciphers else {}),
        uds=args.uds,
        h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
        **({"log_config": args.log_config_file} if args.log_config_file else {}),
    )
    _Server(config).run()
    if stop_stats is not None:
        stop_stats.set()
    engine.stop()
    return 0
