"""The `pagedllm` command: `pagedllm generate [PROMPT ...] [--model M] [--max-tokens N] ...`, `pagedllm chat ...`,
`pagedllm serve [MODEL] ...`, `pagedllm run-batch -i IN.jsonl -o OUT.jsonl [MODEL] ...`,
`pagedllm bench latency | throughput | serve ...`."""

from __future__ import annotations

import argparse
import json
import sys

from pagedllm.entrypoints.chat_cli import add_chat_parser


def _read_prompts(path: str) -> list:
    prompts: list = []
    with open(path, encoding="utf-8") as f:
        if path.endswith(".jsonl"):
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                item = json.loads(line)
                if isinstance(item, str):
                    prompts.append(item)
                elif isinstance(item, dict) and ("prompt" in item or "prompt_token_ids" in item):
                    prompts.append(item)
                else:
                    raise ValueError(f"{path}:{n}: expected a string or an object with 'prompt' or 'prompt_token_ids'")
        else:
            prompts.extend(line.rstrip("\n") for line in f if line.strip())
    return prompts


def _generate(args: argparse.Namespace) -> int:
    from pagedllm import LLM, SamplingParams

    prompts = list(args.prompts)
    if args.input:
        prompts.extend(_read_prompts(args.input))
    if not prompts:
        prompts = ["Hello, my name is"]
    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )
    outputs = llm.generate(prompts, params, use_tqdm=args.output is not None)
    records = [
        {
            "prompt": o.prompt,
            "text": o.outputs[0].text,
            "finish_reason": o.outputs[0].finish_reason,
            "num_prompt_tokens": len(o.prompt_token_ids),
            "num_output_tokens": len(o.outputs[0].token_ids),
        }
        for o in outputs
    ]
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    else:
        for r in records:
            print(f"Prompt: {r['prompt']!r}\nOutput: {r['text']!r}\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from pagedllm import __version__

    parser = argparse.ArgumentParser(prog="pagedllm", description="pagedllm: LLM inference with vLLM's API")
    parser.add_argument("-v", "--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for prompts")
    gen.add_argument("prompts", nargs="*", help="prompt texts")
    gen.add_argument("--model", default=None, help="model directory, .gguf file or cached repo id (default: bundled)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.add_argument("--input", help="prompts file: .txt (one per line) or .jsonl (strings or {'prompt': ...})")
    gen.add_argument("--output", help="write results as JSON lines to this file")
    gen.set_defaults(func=_generate)
    from pagedllm.entrypoints.embed_cli import add_embed_parser

    add_embed_parser(sub)
    add_chat_parser(sub)
    from pagedllm.entrypoints.openai.cli_args import add_serve_parser

    add_serve_parser(sub)
    from pagedllm.entrypoints.openai.run_batch import add_run_batch_parser

    add_run_batch_parser(sub)
    from pagedllm.entrypoints.collect_env import add_collect_env_parser

    add_collect_env_parser(sub)
    from pagedllm.benchmarks import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from pagedllm.entrypoints.cli_config import expand_config

    try:
        argv = expand_config(sys.argv[1:] if argv is None else list(argv))
    except (ValueError, OSError) as e:
        print(f"pagedllm: error: {e}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, OSError) as e:
        print(f"pagedllm: error: {e}", file=sys.stderr)
        return 2
