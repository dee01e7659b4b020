"""`pagedllm chat`: an interactive terminal chat that keeps the conversation and streams each reply as it is made.

`/exit` or end of input quits; Ctrl-C during a reply stops that reply (the engine stays usable), Ctrl-C at the
prompt quits. The loop takes its streams as arguments, so it runs the same on a terminal and on `io.StringIO`."""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from pagedllm.entrypoints.chat_utils import apply_chat_template

EXIT_COMMAND = "/exit"


def add_chat_parser(sub: Any) -> None:
    chat = sub.add_parser("chat", help="chat with a model in the terminal; replies stream as they are generated")
    chat.add_argument("--model", default=None, help="model directory, .gguf file or cached repo id (default: bundled)")
    chat.add_argument("--system", default=None, help="a system message that starts the conversation")
    chat.add_argument("--max-tokens", type=int, default=512, help="the longest reply, in tokens")
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--top-p", type=float, default=1.0)
    chat.add_argument("--top-k", type=int, default=0)
    chat.add_argument("--seed", type=int, default=0)
    chat.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    chat.add_argument("--chat-template", default=None, help="a Jinja chat template or its file (default: the model's)")
    chat.add_argument("--dtype", default="auto")
    chat.add_argument("--max-model-len", type=int, default=None)
    chat.set_defaults(func=_chat_command)


def _chat_command(args: argparse.Namespace) -> int:
    from pagedllm import LLM, SamplingParams

    params = SamplingParams(  # checked before the model loads
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
    )
    try:
        llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed)
    except KeyboardInterrupt:  # Ctrl-C while the model loads
        return 130
    run_chat(llm, params, system=args.system, chat_template=args.chat_template)
    return 0


def _read_line(stdin: TextIO, stdout: TextIO) -> str | None:
    """One line of user input without its newline; None at end of input or Ctrl-C."""
    try:
        if stdin is sys.stdin and stdin.isatty():
            try:
                import readline  # noqa: F401 - line editing and history for input()
            except ImportError:
                pass
            return input("> ")
        line = stdin.readline()
        return line.rstrip("\n") if line else None
    except (EOFError, KeyboardInterrupt):
        stdout.write("\n")
        return None


def run_chat(
    llm,
    params,
    *,
    system: str | None = None,
    chat_template: str | None = None,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> list[dict]:
    """Reads user lines, streams each reply to `stdout`, until /exit or end of input; returns the conversation."""
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    conversation: list[dict] = [{"role": "system", "content": system}] if system else []
    while True:
        line = _read_line(stdin, stdout)
        if line is None or line.strip() == EXIT_COMMAND:
            return conversation
        if not line.strip():
            continue
        conversation.append({"role": "user", "content": line})
        try:
            reply = stream_reply(llm, conversation, params, stdout, chat_template)
        except (ValueError, TypeError) as e:  # e.g. the conversation outgrew max_model_len
            conversation.pop()
            stderr.write(f"error: {e}\n")
            continue
        conversation.append({"role": "assistant", "content": reply})


def stream_reply(llm, conversation: list[dict], params, out: TextIO, chat_template: str | None = None) -> str:
    """Generates the assistant's reply, writing each new piece of text as soon as the engine makes it.

    Ctrl-C stops the reply: the request is aborted and the text shown so far is returned."""
    engine = llm.llm_engine
    text, ids = apply_chat_template(
        llm.get_tokenizer(), conversation, chat_template=chat_template, model_path=engine.config.model.model_path
    )
    requests, state = engine.make_request(text, ids, params)
    engine.add(requests, state)
    shown, done = "", False
    try:
        while not done and engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id != state.req_id:
                    continue
                new_text = output.outputs[0].text
                out.write(new_text[len(shown) :])
                out.flush()
                shown, done = new_text, output.finished
    except KeyboardInterrupt:
        engine.abort_request([state.req_id])
    out.write("\n")
    out.flush()
    return shown
