"""CPU decode against llama.cpp (llama-cpp-python) on the bundled SmolLM2-135M-Instruct Q4_1 GGUF: pagedllm's
`LLM()` (default dtype) and llama.cpp on the same GGUF file, same threads, greedy, exactly --max-tokens new tokens a
request, rounds interleaved.

--batch 1 (workload cpu-llamacpp-batch1): each round runs --prompts prompts one at a time through pagedllm, then
through llama.cpp; a request's figure is new tokens over its wall time (prefill of its 10-60 prompt tokens
included, for both).

--batch N > 1 (workload cpu-llamacpp-batchN): N prompts submitted at once; the figure is aggregate new tokens over
the wall time of the whole set (prefills included). llama.cpp runs its multi-sequence batched decoding (one context
with n_seq_max = P, the prompts of P sequences in one llama_batch, then one llama_batch of P tokens a step, greedy
argmax over the returned logits rows; the N prompts in groups of P). A sweep over --parallel sizes picks llama.cpp's
best P; then each round runs pagedllm, llama.cpp at that P, and HF transformers `generate` (left-padded batch of
--hf-batch, same dtype as pagedllm; 0 skips it).

llama-cpp-python runs in its own virtual environment (built on first use with pip, from source, into
<cache root>/bench/llamacpp-venv; --venv to point elsewhere) as a child process that answers one request at a time
on stdin/stdout, so the engines never share a process or an OpenMP runtime. One JSON line with every round's
figures, ratios and the load average around each round; the median ratio is the figure to quote on a shared machine.

    python benchmarks/cpu_llamacpp.py --rounds 5 --prompts 2 --max-tokens 128
    python benchmarks/cpu_llamacpp.py --batch 64 --rounds 3 --max-tokens 64 --parallel 8,16,32,64
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
from typing import Any

import torch

try:
    from benchmarks.common import emit, git_commit, machine_description, make_record, rounded, usable_cores
    from benchmarks.cpu_throughput import (
        GGUF_NAME,
        build_prompts,
        gguf_dir,
        hf_generate,
        load_hf_model,
        load_hf_tokenizer,
    )
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    from common import emit, git_commit, machine_description, make_record, rounded, usable_cores
    from cpu_throughput import GGUF_NAME, build_prompts, gguf_dir, hf_generate, load_hf_model, load_hf_tokenizer

# The child loads the GGUF once, then answers request lines with {"tokens", "seconds"}:
#   {"prompt": [...], "max_tokens": n}: Llama.generate greedily (top_k=1), exactly n tokens (it does not stop at
#     EOS by itself);
#   {"prompts": [[...], ...], "max_tokens": n, "parallel": P}: batched decoding through the low-level API, P
#     sequences of one context at a time, exactly n tokens each, greedy argmax of each sequence's logits row.
WORKER = """
import json, sys, time
import numpy as np
import llama_cpp as L
from llama_cpp import Llama
path, threads = sys.argv[1], int(sys.argv[2])
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512, n_batch=512, verbose=False)
n_vocab, contexts, CHUNK = llm.n_vocab(), {}, 4096

def context(parallel, n_ctx):
    if contexts.get(parallel, (0, 0, 0))[2] < n_ctx:
        p = L.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, CHUNK, 512, parallel
        p.n_threads = p.n_threads_batch = threads
        contexts[parallel] = (L.llama_init_from_model(llm.model, p), L.llama_batch_init(CHUNK, 0, 1), n_ctx)
    return contexts[parallel][:2]

def decode(ctx, batch, rows):
    # rows: (token, position, sequence, wants logits); returns the argmax of each logits row, in row order
    picks = []
    for start in range(0, len(rows), CHUNK):
        chunk = rows[start : start + CHUNK]
        for i, (tok, pos, seq, out) in enumerate(chunk):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos, 1, out
            batch.seq_id[i][0] = seq
        batch.n_tokens = len(chunk)
        assert L.llama_decode(ctx, batch) == 0
        n_out = sum(r[3] for r in chunk)
        if n_out:
            logits = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(n_out, n_vocab))
            picks.extend(logits.argmax(1).tolist())
    return picks

def batched(prompts, max_tokens, parallel):
    # cells per sequence: the longest prompt + max_tokens, rounded up to llama.cpp's 256-cell padding
    ctx, batch = context(parallel, parallel * -(-(max(map(len, prompts)) + max_tokens) // 256) * 256)
    out = []
    for g in range(0, len(prompts), parallel):
        group = prompts[g : g + parallel]
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        rows = [(t, i, s, i == len(p) - 1) for s, p in enumerate(group) for i, t in enumerate(p)]
        seqs = [[t] for t in decode(ctx, batch, rows)]
        for step in range(max_tokens - 1):
            rows = [(seq[-1], len(p) + step, s, True) for s, (p, seq) in enumerate(zip(group, seqs))]
            for seq, t in zip(seqs, decode(ctx, batch, rows)):
                seq.append(t)
        out.extend(seqs)
    return out

def single(prompt, max_tokens):
    llm.reset()
    out = []
    for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        out.append(token)
        if len(out) == max_tokens:
            return out

print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    start = time.perf_counter()
    if "prompts" in req:
        out = batched(req["prompts"], req["max_tokens"], req["parallel"])
    else:
        out = single(req["prompt"], req["max_tokens"])
    print(json.dumps({"tokens": out, "seconds": time.perf_counter() - start}), flush=True)
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from pagedllm import envs

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--batch", type=int, default=1, help="concurrent requests (default 1: one at a time)")
    p.add_argument("--prompts", type=int, default=2, help="batch 1: requests per engine per round (default 2)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (default 128)")
    p.add_argument("--threads", type=int, default=usable_cores(), help="threads of every engine (default: all cores)")
    p.add_argument("--parallel", default="8,16,32,64", help="batch > 1: llama.cpp sequence counts to sweep")
    p.add_argument("--hf-batch", type=int, default=None, help="batch > 1: HF batch size (default --batch; 0: no HF)")
    p.add_argument("--venv", default=str(Path(envs.cache_root()) / "bench" / "llamacpp-venv"))
    p.add_argument("--no-append", action="store_true", help="do not append to benchmarks/results.jsonl")
    args = p.parse_args(argv)
    args.parallel = sorted({min(int(x), args.batch) for x in args.parallel.split(",")})
    args.hf_batch = args.batch if args.hf_batch is None else min(args.hf_batch, args.batch)
    return args


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

    def ask(self, **request: Any) -> tuple[Any, float]:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        return answer["tokens"], answer["seconds"]

    def run(self, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
        return self.ask(prompt=prompt, max_tokens=max_tokens)

    def run_batch(self, prompts: list[list[int]], max_tokens: int, parallel: int) -> tuple[list[list[int]], float]:
        return self.ask(prompts=prompts, max_tokens=max_tokens, parallel=parallel)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def timed_generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    """pagedllm: all prompts submitted at once, from an empty prefix cache; (new tokens per prompt, seconds)."""
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - start


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """Equal greedy sequences, and the mean fraction of each sequence before the first differing token."""
    prefix = [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), min(len(s), len(t))) for s, t in zip(a, b)]
    return {
        "same": f"{sum(s == t for s, t in zip(a, b))}/{len(a)}",
        "prefix": rounded(sum(prefix) / sum(map(len, a)), 3),
    }


def load() -> float:
    return rounded(os.getloadavg()[0])


def bench_batch1(args: argparse.Namespace, llm: Any, peer: LlamaCpp) -> dict[str, Any]:
    prompts = build_prompts(load_hf_tokenizer(), args.prompts, seed=0)
    for run in (lambda p: timed_generate(llm, [p], 8), lambda p: peer.run(p, 8)):  # caches, kernels, thread pools
        run(prompts[0][:8])
    rounds, same, loads = [], 0, []
    for _ in range(args.rounds):
        loads.append(load())
        mine = [timed_generate(llm, [p], args.max_tokens) for p in prompts]
        theirs = [peer.run(p, args.max_tokens) for p in prompts]
        same += sum(a[0][0] == b[0] for a, b in zip(mine, theirs))
        rounds.append([len(prompts) * args.max_tokens / sum(s for _, s in runs) for runs in (mine, theirs)])
    loads.append(load())
    ratios = [a / b for a, b in rounds]
    return {
        "pagedllm_tok_s": rounded(statistics.median(a for a, _ in rounds)),
        "llamacpp_tok_s": rounded(statistics.median(b for _, b in rounds)),
        "ratio_median": rounded(statistics.median(ratios), 3),
        "ratio_runs": [rounded(r, 3) for r in ratios],
        "pagedllm_tok_s_runs": [rounded(a) for a, _ in rounds],
        "llamacpp_tok_s_runs": [rounded(b) for _, b in rounds],
        "same_greedy_sequences": f"{same}/{args.rounds * len(prompts)}",
        "load_average_1min": loads,
        "prompts": args.prompts,
    }


class HF:
    """HF transformers `generate` on the same GGUF (dequantized by transformers), the dtype pagedllm runs."""

    def __init__(self, dtype: torch.dtype, batch: int) -> None:
        tokenizer = load_hf_tokenizer()
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.model, self.batch = load_hf_model(str(dtype).replace("torch.", "")), batch

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
        start, out = time.perf_counter(), []
        for i in range(0, len(prompts), self.batch):
            out += hf_generate(self.model, prompts[i : i + self.batch], max_tokens, self.pad)
        return out, time.perf_counter() - start


def bench_batched(args: argparse.Namespace, llm: Any, peer: LlamaCpp) -> dict[str, Any]:
    prompts = build_prompts(load_hf_tokenizer(), args.batch, seed=0)
    tokens = len(prompts) * args.max_tokens
    hf = HF(llm.llm_engine.config.model.dtype, args.hf_batch) if args.hf_batch else None
    timed_generate(llm, prompts[:4], 8)  # warm-up: caches, kernels, thread pools
    peer.run_batch(prompts[:4], 8, 4)
    if hf:
        hf.run(prompts[:4], 8)
    sweep = {}
    for p in args.parallel:
        sweep[p] = tokens / peer.run_batch(prompts, args.max_tokens, p)[1]
        print(f"llama.cpp, {p} sequences: {sweep[p]:.1f} tok/s (load {load()})", file=sys.stderr, flush=True)
    best = max(sweep, key=sweep.__getitem__)
    runs: dict[str, list[float]] = {"pagedllm": [], "llamacpp": [], "hf": []}
    seqs: dict[str, list[list[int]]] = {}
    loads = []
    for _ in range(args.rounds):
        loads.append(load())
        engines = {"pagedllm": lambda: timed_generate(llm, prompts, args.max_tokens)}
        engines["llamacpp"] = lambda: peer.run_batch(prompts, args.max_tokens, best)
        if hf:
            engines["hf"] = lambda: hf.run(prompts, args.max_tokens)
        for name, run in engines.items():
            seqs[name], seconds = run()
            runs[name].append(tokens / seconds)
            print(f"{name}: {tokens / seconds:.1f} tok/s (load {load()})", file=sys.stderr, flush=True)
    loads.append(load())
    figures = {f"{name}_tok_s": rounded(statistics.median(r)) for name, r in runs.items() if r} | {
        f"{name}_tok_s_runs": [rounded(x) for x in r] for name, r in runs.items() if r
    }
    for peer_name in ("llamacpp", "hf"):
        ratios = [a / b for a, b in zip(runs["pagedllm"], runs[peer_name])]
        if ratios:
            figures[f"ratio_{peer_name}_median"] = rounded(statistics.median(ratios), 3)
            figures[f"ratio_{peer_name}_runs"] = [rounded(r, 3) for r in ratios]
            agree = agreement(seqs["pagedllm"], seqs[peer_name])
            figures[f"same_greedy_sequences_{peer_name}"] = agree["same"]
            figures[f"agreeing_prefix_{peer_name}"] = agree["prefix"]
    return {
        **figures,
        "llamacpp_parallel": best,
        "llamacpp_tok_s_by_parallel": {str(p): rounded(v) for p, v in sweep.items()},
        "hf_batch": args.hf_batch,
        "load_average_1min": loads,
        "batch": args.batch,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from pagedllm import LLM

    peer = LlamaCpp(llamacpp_python(args.venv), args.threads)
    llm = LLM()
    figures = (bench_batch1 if args.batch == 1 else bench_batched)(args, llm, peer)
    peer.close()
    figures |= {
        "dtype": str(llm.llm_engine.config.model.dtype).replace("torch.", ""),
        "threads": args.threads,
        "max_tokens": args.max_tokens,
    }
    workload = f"cpu-llamacpp-batch{args.batch}"
    emit(make_record(workload, machine_description(), git_commit(), **figures), not args.no_append)
    return 0


if __name__ == "__main__":
    sys.exit(main())
