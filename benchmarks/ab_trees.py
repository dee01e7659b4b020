"""A/B of two pagedllm source trees on the same machine, in alternating fresh interpreters.

Each round runs the same workload once with tree A and once with tree B (the order swaps every round), each in a
new Python process that imports pagedllm from its tree, and prints one JSON line per run. The summary line gives
each tree's median output tok/s and B / A. Use it to show a restructuring costs no speed:

    python benchmarks/ab_trees.py --a /path/to/old/checkout --b . --rounds 3                      # CPU, bundled model
    python benchmarks/ab_trees.py --a old --b . --model benchmarks/configs/qwen3-0.6b --dummy --device cuda \
        --num-prompts 256 --max-tokens 256

Workloads: `--num-prompts` prompts of 10-60 random token ids (seeded, the same for both trees), greedy,
ignore_eos, exactly `--max-tokens` new tokens each; tok/s counts output tokens over the generate call.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

RUN_CODE = """
import json, random, sys, time
import torch
torch.set_num_threads({threads})
from pagedllm import LLM, SamplingParams
kw = dict(dtype={dtype!r}, max_model_len=1024, enable_prefix_caching=False)
if {model!r}:
    kw["model"] = {model!r}
if {dummy!r}:
    kw.update(load_format="dummy", skip_tokenizer_init=True)
llm = LLM(**kw)
rng = random.Random(0)
prompts = [{{"prompt_token_ids": [rng.randrange(100, 20000) for _ in range(rng.randint(10, 60))]}}
           for _ in range({num_prompts})]
params = SamplingParams(temperature=0, max_tokens={max_tokens}, ignore_eos=True)
llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
if torch.cuda.is_available():
    torch.cuda.synchronize()
t0 = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
seconds = time.perf_counter() - t0
tokens = sum(len(o.outputs[0].token_ids) for o in outs)
first = outs[0].outputs[0].token_ids[:8]
print("RESULT " + json.dumps({{"tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens, "first": first}}))
"""


def run_tree(tree: str, args: argparse.Namespace) -> dict:
    code = RUN_CODE.format(
        threads=args.threads,
        dtype=args.dtype,
        model=args.model,
        dummy=args.dummy,
        num_prompts=args.num_prompts,
        max_tokens=args.max_tokens,
    )
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tree)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"tree {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT ") :])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", required=True, help="tree A (the baseline checkout)")
    p.add_argument("--b", required=True, help="tree B (the candidate checkout)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--model", default="", help="model path (default: the bundled model)")
    p.add_argument("--dummy", action="store_true", help="load_format='dummy' (a config.json folder)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--label", default="", help="a name for this workload in the output lines")
    args = p.parse_args(argv)
    runs: dict[str, list[float]] = {"a": [], "b": []}
    firsts: dict[str, list] = {}
    for r in range(args.rounds):
        order = ("a", "b") if r % 2 == 0 else ("b", "a")
        for side in order:
            res = run_tree(getattr(args, side), args)
            runs[side].append(res["tok_s"])
            firsts.setdefault(side, res["first"])
            print(json.dumps({"label": args.label, "round": r, "tree": side, **res}), flush=True)
    a, b = statistics.median(runs["a"]), statistics.median(runs["b"])
    summary = {"label": args.label, "a_tok_s": round(a, 2), "b_tok_s": round(b, 2), "b_over_a": round(b / a, 4)}
    summary["same_first_tokens"] = firsts["a"] == firsts["b"]
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
