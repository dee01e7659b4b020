"""Batch-1 decode on CPU: pagedllm's `LLM()` (the bundled SmolLM2-135M-Instruct Q4_1 GGUF, default dtype) against
llama.cpp (llama-cpp-python) on the same GGUF file, same threads, greedy, exactly --max-tokens new tokens a request.

llama-cpp-python runs in its own virtual environment (built on first use with pip, from source, into
<cache root>/bench/llamacpp-venv; --venv to point elsewhere) as a child process that answers one request at a time
on stdin/stdout, so the two engines never share a process or an OpenMP runtime. Rounds are interleaved: each round
runs the same prompts one at a time through pagedllm, then through llama.cpp; a request's figure is new tokens over
its wall time (prefill of its 10-60 prompt tokens included, for both). One JSON line (workload cpu-llamacpp-batch1)
with every round's tok/s and ratio; the median ratio is the figure to quote on a shared machine.

    python benchmarks/cpu_llamacpp.py --rounds 5 --prompts 2 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

try:
    from benchmarks.common import emit, git_commit, machine_description, make_record, rounded, usable_cores
    from benchmarks.cpu_throughput import GGUF_NAME, build_prompts, gguf_dir, load_hf_tokenizer
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    from common import emit, git_commit, machine_description, make_record, rounded, usable_cores
    from cpu_throughput import GGUF_NAME, build_prompts, gguf_dir, load_hf_tokenizer

# The child: loads the GGUF once, then per request line {"prompt": [...], "max_tokens": n} generates greedily
# (top_k=1) exactly n tokens (Llama.generate does not stop at EOS by itself) and answers {"tokens", "seconds"}.
WORKER = """
import json, sys, time
from llama_cpp import Llama
path, threads = sys.argv[1], int(sys.argv[2])
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512, n_batch=512, verbose=False)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    llm.reset()
    start, out = time.perf_counter(), []
    for token in llm.generate(req["prompt"], top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        out.append(token)
        if len(out) == req["max_tokens"]:
            break
    print(json.dumps({"tokens": out, "seconds": time.perf_counter() - start}), flush=True)
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from pagedllm import envs

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--prompts", type=int, default=2, help="requests per engine per round (default 2)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (default 128)")
    p.add_argument("--threads", type=int, default=usable_cores(), help="threads of both engines (default: all cores)")
    p.add_argument("--venv", default=str(Path(envs.cache_root()) / "bench" / "llamacpp-venv"))
    p.add_argument("--no-append", action="store_true", help="do not append to benchmarks/results.jsonl")
    return p.parse_args(argv)


def llamacpp_python(venv: str) -> str:
    """The venv's python with llama_cpp importable; the venv is made (and llama-cpp-python built) when missing."""
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    if subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode != 0:
        print("building llama-cpp-python from source (many minutes on 2 cores)", file=sys.stderr)
        subprocess.run([python, "-m", "pip", "install", "llama-cpp-python"], check=True)
    return python


class LlamaCpp:
    def __init__(self, python: str, threads: int) -> None:
        path = os.path.join(gguf_dir(), GGUF_NAME)
        self.proc = subprocess.Popen(
            [python, "-c", WORKER, path, str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert json.loads(self.proc.stdout.readline())["ready"]

    def run(self, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
        self.proc.stdin.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        return answer["tokens"], answer["seconds"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from pagedllm import LLM, SamplingParams

    prompts = build_prompts(load_hf_tokenizer(), args.prompts, seed=0)
    peer = LlamaCpp(llamacpp_python(args.venv), args.threads)
    llm = LLM()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    def ours(prompt: list[int]) -> tuple[list[int], float]:
        llm.reset_prefix_cache()
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return list(out[0].outputs[0].token_ids), time.perf_counter() - start

    for run in (ours, lambda p: peer.run(p, args.max_tokens)):  # warm-up: caches, kernels, thread pools
        run(prompts[0][:8])
    rounds, same = [], 0
    for _ in range(args.rounds):
        mine = [ours(p) for p in prompts]
        theirs = [peer.run(p, args.max_tokens) for p in prompts]
        same += sum(a[0] == b[0] for a, b in zip(mine, theirs))
        tok_s = [len(prompts) * args.max_tokens / sum(s for _, s in runs) for runs in (mine, theirs)]
        rounds.append(tok_s)
    peer.close()
    ratios = [a / b for a, b in rounds]
    figures = {
        "pagedllm_tok_s": rounded(statistics.median(a for a, _ in rounds)),
        "llamacpp_tok_s": rounded(statistics.median(b for _, b in rounds)),
        "ratio_median": rounded(statistics.median(ratios), 3),
        "ratio_runs": [rounded(r, 3) for r in ratios],
        "pagedllm_tok_s_runs": [rounded(a) for a, _ in rounds],
        "llamacpp_tok_s_runs": [rounded(b) for _, b in rounds],
        "same_greedy_sequences": f"{same}/{args.rounds * len(prompts)}",
        "dtype": str(llm.llm_engine.config.model.dtype).replace("torch.", ""),
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "prompts": args.prompts,
    }
    emit(make_record("cpu-llamacpp-batch1", machine_description(), git_commit(), **figures), not args.no_append)
    return 0


if __name__ == "__main__":
    sys.exit(main())
