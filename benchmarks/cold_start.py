"""Cold start: `LLM()` to the first token, each run in a fresh interpreter, with the start-up time split.

Run 1 ("fresh") gets an empty TRITON_CACHE_DIR (every Triton kernel compiles, as on a fresh machine); run 2
("second") reuses that directory (the kernels come from the disk cache). Dummy weights from a config.json
(benchmarks/configs), so the weights phase is their allocation and random fill, not a disk read. Each run prints one
JSON line (appended to benchmarks/results.jsonl unless --no-append):
  seconds             process start (before `import pagedllm`) to the first token: import + LLM() + first generate
  import_s            `import pagedllm`
  llm_init_s          LLM(...)
  first_token_s       the first generate (a 3-token prompt, 1 token, SamplingParams' defaults: temperature 1)
  split               LLM.startup_seconds: config, tokenizer, weights, compile (Triton pre-compile; on CPU the C
                      kernels' build), kv_profile, kv_cache, graph_capture, engine_other, total
  process_s           the child process's wall time seen from here (interpreter start and exit included)

    python benchmarks/cold_start.py --model-shape qwen3-0.6b
    python benchmarks/cold_start.py --model-shape llama-3.1-8b
    python benchmarks/cold_start.py --model-shape qwen3-0.6b --compile-threads 0        # kernels compile on first use
    python benchmarks/cold_start.py --model-shape qwen3-0.6b --lazy-cudagraph-capture
    python benchmarks/cold_start.py --model-shape tiny --device cpu --no-append          # CPU smoke (a tiny Llama)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    from benchmarks.common import BENCH_DIR, REPO_ROOT, emit, git_commit, machine_description, make_record, rounded
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    from common import BENCH_DIR, REPO_ROOT, emit, git_commit, machine_description, make_record, rounded

SHAPES = ("qwen3-0.6b", "llama-3.1-8b", "llama-3.2-1b", "tiny")
TINY = {  # a tiny Llama for the CPU smoke run
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
}
# the child: times `import pagedllm`, LLM(**kwargs) and the first generate; its last stdout line is a JSON object
CHILD = """
import json, sys, time
t0 = time.perf_counter()
import pagedllm
t1 = time.perf_counter()
from pagedllm import LLM, SamplingParams
llm = LLM(**json.loads(sys.argv[1]))
t2 = time.perf_counter()
out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=1), use_tqdm=False)
t3 = time.perf_counter()
assert len(out[0].outputs[0].token_ids) == 1
print(json.dumps({"seconds": t3 - t0, "import_s": t1 - t0, "llm_init_s": t2 - t1, "first_token_s": t3 - t2,
                  "split": llm.startup_seconds}))
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-shape", choices=SHAPES, default="qwen3-0.6b", help="config.json of benchmarks/configs")
    p.add_argument("--model", help="a model folder instead (its config.json; weights stay dummy)")
    p.add_argument("--device", default=None, help="pagedllm's device (default: cuda when there is one)")
    p.add_argument("--max-model-len", type=int, default=None, help="default 4096 (tiny: its own, 512)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="fixed KV cache (default: profiled)")
    p.add_argument("--compile-threads", type=int, default=None, help="compilation_config compile_threads")
    p.add_argument("--lazy-cudagraph-capture", action="store_true", help="compilation_config lazy_cudagraph_capture")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--runs", default="fresh,second", help="comma-separated: fresh (empty Triton cache), second")
    p.add_argument("--triton-cache-dir", help="the Triton cache of the runs (default: a new empty folder)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--no-append", action="store_true", help="do not append to benchmarks/results.jsonl")
    args = p.parse_args(argv)
    runs = args.runs.split(",")
    if not runs or any(r not in ("fresh", "second") for r in runs):
        p.error(f"--runs={args.runs!r}: a comma-separated list of fresh, second")
    args.runs = runs
    return args


def model_dir(args: argparse.Namespace, scratch: Path) -> str:
    if args.model:
        return args.model
    if args.model_shape != "tiny":
        return str(BENCH_DIR / "configs" / args.model_shape)
    path = scratch / "tiny-llama"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY), encoding="utf-8")
    return str(path)


def llm_kwargs(args: argparse.Namespace, model: str) -> dict:
    compilation = {"lazy_cudagraph_capture": args.lazy_cudagraph_capture}
    if args.compile_threads is not None:
        compilation["compile_threads"] = args.compile_threads
    kwargs = {
        "model": model,
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "max_model_len": args.max_model_len or (None if args.model_shape == "tiny" else 4096),
        "max_num_seqs": args.max_num_seqs,
        "enforce_eager": args.enforce_eager,
        "compilation_config": compilation,
    }
    for key in ("device", "kv_cache_memory_bytes"):
        if getattr(args, key) is not None:
            kwargs[key] = getattr(args, key)
    return kwargs


def run_child(kwargs: dict, cache_dir: str, timeout: float) -> dict:
    """One start in a fresh interpreter with TRITON_CACHE_DIR=cache_dir; its figures and its wall time."""
    env = {**os.environ, "TRITON_CACHE_DIR": cache_dir, "PYTHONPATH": str(REPO_ROOT)}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(kwargs)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"cold-start run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    figures["process_s"] = wall
    return figures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    machine, commit = machine_description(), git_commit()
    with tempfile.TemporaryDirectory(prefix="pagedllm-cold-start-") as scratch:
        model = model_dir(args, Path(scratch))
        cache_dir = args.triton_cache_dir or str(Path(scratch) / "triton-cache")
        kwargs = llm_kwargs(args, model)
        for run in args.runs:
            if run == "fresh" and os.path.isdir(cache_dir) and os.listdir(cache_dir):
                raise SystemExit(f"--triton-cache-dir {cache_dir} is not empty: a fresh run needs an empty cache")
            figures = run_child(kwargs, cache_dir, args.timeout)
            split = {k: rounded(v, 3) for k, v in figures.pop("split").items()}
            record = make_record(
                "cold-start",
                machine,
                commit,
                run=run,
                model_shape="custom" if args.model else args.model_shape,
                **{k: rounded(v, 3) for k, v in figures.items()},
                split=split,
                compile_threads=args.compile_threads,
                lazy_cudagraph_capture=args.lazy_cudagraph_capture,
                enforce_eager=args.enforce_eager,
                max_num_seqs=args.max_num_seqs,
            )
            emit(record, append=not args.no_append)
    return 0


if __name__ == "__main__":
    sys.exit(main())
