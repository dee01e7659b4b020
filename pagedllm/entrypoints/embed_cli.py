"""`pagedllm embed --input FILE [--model M] [--output FILE.jsonl]`: one embedding per input line, as JSON lines."""

from __future__ import annotations

import argparse
import json
import sys


def read_texts(path: str) -> list[str]:
    """Input texts: .jsonl lines are strings or objects with a "text" (or "prompt" / "input") string; any other
    file has one text per non-empty line."""
    texts: list[str] = []
    with open(path, encoding="utf-8") as f:
        if not path.endswith(".jsonl"):
            return [line.rstrip("\n") for line in f if line.strip()]
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            item = json.loads(line)
            if isinstance(item, dict):
                item = next((item[k] for k in ("text", "prompt", "input") if isinstance(item.get(k), str)), None)
            if not isinstance(item, str):
                raise ValueError(f"{path}:{n}: expected a JSON string or an object with a 'text' string")
            texts.append(item)
    return texts


def _embed(args: argparse.Namespace) -> int:
    from pagedllm import LLM, PoolingParams

    texts = read_texts(args.input)
    if not texts:
        raise ValueError(f"--input {args.input}: the file holds no text")
    llm = LLM(args.model, task="embed", dtype=args.dtype, max_model_len=args.max_model_len)
    params = PoolingParams(dimensions=args.dimensions, truncate_prompt_tokens=args.truncate_prompt_tokens)
    outputs = llm.embed(texts, pooling_params=params, use_tqdm=args.output is not None)
    out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    try:
        for i, (text, o) in enumerate(zip(texts, outputs)):
            record = {"index": i, "text": text, "num_tokens": len(o.prompt_token_ids), "embedding": o.outputs.embedding}
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    return 0


def add_embed_parser(sub) -> None:
    emb = sub.add_parser("embed", help="embed texts (one per line) with an embedding model")
    emb.add_argument("--input", required=True, help="texts file: .txt (one per line) or .jsonl (strings or {'text'})")
    emb.add_argument("--model", default=None, help="embedding model directory (default: bundled all-MiniLM-L6-v2)")
    emb.add_argument("--output", help="write JSON lines to this file (default: stdout)")
    emb.add_argument("--dtype", default="auto")
    emb.add_argument("--max-model-len", type=int, default=None)
    emb.add_argument("--dimensions", type=int, default=None, help="Matryoshka truncation (models that support it)")
    emb.add_argument("--truncate-prompt-tokens", type=int, default=None, help="cut longer texts (-1: max_model_len)")
    emb.set_defaults(func=_embed)
