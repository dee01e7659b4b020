"""Automatic prefix caching: one shared prefix (~1,000 tokens) with 8 and with 64 different suffixes, generated
with prefix caching on and off in the same run. One JSON line per suffix count (appended to
benchmarks/results.jsonl unless --no-append):

  prefix-cache-<k>   seconds with caching off and on (best of --repeats, the cache reset before each timed run, so
                     the first request computes the prefix every time), the speedup, the cached prompt tokens, and
                     whether the greedy tokens of both runs agree

Prompts are random token ids (seeded by --seed), so the figures do not depend on a tokenizer. Decoding is greedy,
exactly --max-tokens new tokens per request (ignore_eos).

    python benchmarks/prefix_cache.py                                   # the bundled model on this CPU
    python benchmarks/prefix_cache.py --model benchmarks/configs/qwen3-0.6b --load-format dummy   # e.g. on a GPU
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
    p.add_argument("--prefix-tokens", type=int, default=1000)
    p.add_argument("--suffix-tokens", default="16,48", help="suffix length range lo,hi (tokens)")
    p.add_argument("--suffixes", default="8,64", help="comma-separated numbers of suffixes")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-append", action="store_true")
    return p.parse_args(argv)


def build_prompts(vocab: int, prefix_len: int, num: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    low = min(1000, vocab // 10)  # keep clear of the special tokens at the start of most vocabularies
    prefix = [rng.randrange(low, vocab) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(low, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(num)]


def run(llm: Any, prompts: list[list[int]], params: Any, repeats: int) -> tuple[float, list, int]:
    """Best wall time of generating all prompts at once, starting each time from an empty prefix cache."""
    best, outs = float("inf"), []
    for _ in range(repeats):
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        best = min(best, time.perf_counter() - start)
    return best, [o.outputs[0].token_ids for o in outs], sum(o.num_cached_tokens for o in outs)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    from pagedllm import LLM, SamplingParams

    lo, hi = (int(x) for x in args.suffix_tokens.split(","))
    counts = [int(x) for x in args.suffixes.split(",")]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    machine, commit = machine_description(), git_commit()
    need = max(counts) * (args.prefix_tokens + hi + args.max_tokens)  # tokens cached at once without sharing
    results: dict[bool, dict[int, tuple]] = {}
    for caching in (False, True):
        llm = LLM(
            args.model,
            load_format=args.load_format,
            dtype=args.dtype,
            enable_prefix_caching=caching,
            max_num_seqs=max(counts),
            max_model_len=args.prefix_tokens + hi + args.max_tokens,
            skip_tokenizer_init=args.load_format == "dummy",
        )
        blocks = llm.llm_engine.config.cache.num_blocks * llm.llm_engine.config.cache.block_size
        if blocks < need:
            print(f"note: the cache holds {blocks} tokens, fewer than the {need} of all requests at once")
        vocab = llm.llm_engine.config.model.vocab_size
        llm.generate([{"prompt_token_ids": [7] * 32}], params, use_tqdm=False)  # warm-up
        results[caching] = {
            k: run(llm, build_prompts(vocab, args.prefix_tokens, k, lo, hi, args.seed + k), params, args.repeats)
            for k in counts
        }
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    for k in counts:
        (t_off, tok_off, _), (t_on, tok_on, cached) = results[False][k], results[True][k]
        record = make_record(
            f"prefix-cache-{k}",
            machine,
            commit,
            seconds_off=rounded(t_off, 3),
            seconds_on=rounded(t_on, 3),
            speedup=rounded(t_off / t_on, 2),
            cached_prompt_tokens=cached,
            tokens_equal=tok_off == tok_on,
            prefix_tokens=args.prefix_tokens,
            suffix_tokens=[lo, hi],
            max_tokens=args.max_tokens,
            model=args.model or "bundled SmolLM2-135M-Instruct",
            dtype=args.dtype,
            threads=torch.get_num_threads(),
            seed=args.seed,
        )
        emit(record, append=not args.no_append)


if __name__ == "__main__":
    main()
