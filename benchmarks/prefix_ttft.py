"""Prefix caching, time to first token: N requests (64) sharing a system prompt (2,048 tokens), each with its own
suffix, submitted at once with prefix caching off and on in the same run. One JSON line (appended to
benchmarks/results.jsonl unless --no-append):

  prefix-ttft   time to first token per request (its first token's time minus its arrival, RequestOutput.metrics):
                mean, p50 and p99 with caching off and on, their ratio (off / on: the goal is >= 5x), the wall time
                of the whole batch, the prompt tokens the cache served, and whether the first tokens agree

Before each timed batch the prefix cache is reset and one request with the system prompt (and a suffix of its own)
runs alone, as an earlier conversation would have: with caching on, its blocks are then cached. Best of --repeats
(by mean TTFT). Prompts are random token ids (seeded), greedy, --max-tokens new tokens (1: the prefill only).

    python benchmarks/prefix_ttft.py --model benchmarks/configs/llama-3.1-8b --load-format dummy   # on a GPU
    python benchmarks/prefix_ttft.py --model benchmarks/configs/qwen3-0.6b --load-format dummy
    python benchmarks/prefix_ttft.py --prefix-tokens 256 --requests 8                              # bundled, CPU
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from typing import Any

try:
    from benchmarks.common import emit, git_commit, machine_description, make_record, rounded
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    from common import emit, git_commit, machine_description, make_record, rounded


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model (default: the bundled SmolLM2)")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default=None)
    p.add_argument("--prefix-tokens", type=int, default=2048, help="the shared system prompt")
    p.add_argument("--suffix-tokens", default="16,48", help="each request's own tokens: range lo,hi")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-append", action="store_true")
    return p.parse_args(argv)


def build_prompts(vocab: int, args: argparse.Namespace) -> tuple[list[int], list[list[int]]]:
    """(the primer: system prompt + its own suffix, the requests: system prompt + a suffix each)."""
    rng = random.Random(args.seed)
    lo, hi = (int(x) for x in args.suffix_tokens.split(","))
    low = min(1000, vocab // 10)  # clear of the special tokens at the start of most vocabularies
    system = [rng.randrange(low, vocab) for _ in range(args.prefix_tokens)]
    suffixes = [[rng.randrange(low, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(1 + args.requests)]
    prompts = [system + suffix for suffix in suffixes]
    return prompts[0], prompts[1:]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def timed_batch(llm: Any, primer: list[int], prompts: list[list[int]], params: Any) -> dict:
    llm.reset_prefix_cache()
    llm.generate([{"prompt_token_ids": primer}], params, use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - start
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    return {
        "ttft": ttft,
        "wall": wall,
        "cached": sum(o.num_cached_tokens for o in outs),
        "first_tokens": [o.outputs[0].token_ids[0] for o in outs],
    }


def measure(args: argparse.Namespace, caching: bool, params: Any) -> dict:
    from pagedllm import LLM

    hi = int(args.suffix_tokens.split(",")[1])
    kwargs = {k: getattr(args, k) for k in ("device", "max_num_batched_tokens", "kv_cache_memory_bytes")}
    llm = LLM(
        args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        enable_prefix_caching=caching,
        max_num_seqs=args.requests,
        max_model_len=args.prefix_tokens + hi + args.max_tokens,
        skip_tokenizer_init=args.load_format == "dummy",
        **{k: v for k, v in kwargs.items() if v is not None},
    )
    primer, prompts = build_prompts(llm.llm_engine.config.model.vocab_size, args)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)  # warm-up
    runs = [timed_batch(llm, primer, prompts, params) for _ in range(args.repeats)]
    del llm
    gc.collect()
    return min(runs, key=lambda r: sum(r["ttft"]))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    machine, commit = machine_description(), git_commit()
    off = measure(args, False, params)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    on = measure(args, True, params)
    figures = {}
    for name, run in (("off", off), ("on", on)):
        ttft = run["ttft"]
        figures |= {
            f"ttft_mean_s_{name}": rounded(sum(ttft) / len(ttft), 4),
            f"ttft_p50_s_{name}": rounded(percentile(ttft, 0.5), 4),
            f"ttft_p99_s_{name}": rounded(percentile(ttft, 0.99), 4),
            f"wall_s_{name}": rounded(run["wall"], 4),
        }
    record = make_record(
        "prefix-ttft",
        machine,
        commit,
        **figures,
        ttft_ratio=rounded(sum(off["ttft"]) / sum(on["ttft"]), 2),
        cached_prompt_tokens_on=on["cached"],
        cached_prompt_tokens_off=off["cached"],
        first_tokens_equal=off["first_tokens"] == on["first_tokens"],
        requests=args.requests,
        prefix_tokens=args.prefix_tokens,
        suffix_tokens=args.suffix_tokens,
        max_tokens=args.max_tokens,
        model=args.model or "bundled SmolLM2-135M-Instruct",
        load_format=args.load_format,
        repeats=args.repeats,
    )
    emit(record, append=not args.no_append)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
