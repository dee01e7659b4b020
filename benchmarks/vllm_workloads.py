"""vLLM's own throughput workloads on Llama-3.1-8B shapes (dummy bf16 weights), against vLLM's published figures
and the weights+KV roofline measured in the same run. One JSON line per workload (vllm-throughput-<in>x<out>x<n>;
appended to benchmarks/results.jsonl unless --no-append).

Each workload is what `vllm bench throughput --input-len IN --output-len OUT --num-prompts N` runs, and what
`pagedllm bench throughput` (pagedllm/benchmarks/offline.py: the same `run_throughput`) runs with the same flags:
the random dataset (N prompts of exactly IN random token ids, no special tokens, seed 0), every request at once,
temperature 1, top_p 1, ignore_eos, OUT tokens each, timed as one generate. The engine keeps its defaults (as
vLLM's run did: max_model_len = the model's 131072, max_num_seqs 256, max_num_batched_tokens 8192) and
detokenizes (benchmarks/dummy_model.py's word-level tokenizer of the 128256 ids; --disable-detokenize to skip).
Before the timed run, a warm-up generate of 8 requests compiles the kernels (vLLM warms up inside its start).

Figures: output_tok_s and total_tok_s (vLLM's output_tokens_per_second and tokens_per_second) and
  ratio = ours / vLLM's published figure, the one the workload reports: output tok/s for 32x2048x128 (6,612,
          vLLM 0.13 with torch 2.9 on an H100, published by torchao), total tok/s for 4096x1x32 (30,946, same source)
  roofline_frac = floor_s / elapsed, floor_s = min_bytes / copy bandwidth (gpu_throughput.copy_bandwidth, 4 GiB
          device copy, read + write bytes, measured in this run), min_bytes = weight_bytes * max output length
          + sum_i sum_{t < out_i} (in_i + t) * KV bytes per token (benchmarks/roofline.py's batch_roofline_bytes;
          weight_bytes counts every parameter, as gpu_throughput.py's nanovllm-bench roofline does)
  mfu = prefill FLOPs / elapsed / dense bf16 peak (peak by device name, benchmarks/roofline.py; --peak-tflops):
          per prompt 2 * body_params * IN + 2 * lm_head_params + causal attention 4 * layers * heads * head_dim *
          IN * (IN + 1) / 2; meaningful for the prefill-bound 4096x1 workload

    python benchmarks/vllm_workloads.py --no-append                  # both workloads, ~1.5 min on an H100
    python benchmarks/vllm_workloads.py --tiny --workloads 16x32x8,64x1x4 --no-append     # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

try:
    from benchmarks import roofline
    from benchmarks.common import BENCH_DIR, emit, git_commit, machine_description, make_record, rounded
    from benchmarks.dummy_model import with_tokenizer
    from benchmarks.gpu_throughput import copy_bandwidth, engine_figures
    from benchmarks.long_context import TINY, model_sizes
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    import roofline
    from common import BENCH_DIR, emit, git_commit, machine_description, make_record, rounded
    from dummy_model import with_tokenizer
    from gpu_throughput import copy_bandwidth, engine_figures
    from long_context import TINY, model_sizes

# (input_len, output_len, num_prompts) -> (vLLM's published figure, the result field it compares with)
PUBLISHED = {
    (32, 2048, 128): (6612.0, "output_tok_s"),
    (4096, 1, 32): (30946.0, "total_tok_s"),
}
PUBLISHED_SOURCE = "vLLM 0.13, torch 2.9, H100 (published by torchao)"


def parse_workload(text: str) -> tuple[int, int, int]:
    try:
        values = tuple(int(x) for x in text.split("x"))
    except ValueError:
        values = ()
    if len(values) != 3 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: INPUTxOUTPUTxPROMPTS, e.g. 32x2048x128")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(BENCH_DIR / "configs" / "llama-3.1-8b"), help="config folder (dummy)")
    p.add_argument("--tiny", action="store_true", help="a tiny Llama instead (CPU smoke run)")
    p.add_argument("--workloads", default="32x2048x128,4096x1x32", help="comma-separated INPUTxOUTPUTxPROMPTS")
    p.add_argument("--disable-detokenize", action="store_true")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's (as vLLM's)")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="fixed KV cache (CPU: default 64 MiB)")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak (default: by device name)")
    p.add_argument("--no-append", action="store_true", help="do not append to benchmarks/results.jsonl")
    args = p.parse_args(argv)
    try:
        args.workloads = [parse_workload(w) for w in args.workloads.split(",") if w]
    except argparse.ArgumentTypeError as e:
        p.error(f"--workloads: {e}")
    return args


def make_engine(args: argparse.Namespace, scratch: str):
    from pagedllm import LLM

    config_dir = args.model
    if args.tiny:
        config_dir = str(Path(scratch) / "tiny-config")
        Path(config_dir).mkdir()
        (Path(config_dir) / "config.json").write_text(json.dumps(TINY), encoding="utf-8")
    folder = with_tokenizer(config_dir, str(Path(scratch) / "model"))
    cuda = torch.cuda.is_available()
    kv_bytes = args.kv_cache_memory_bytes or (None if cuda else 64 << 20)
    return LLM(folder, load_format="dummy", max_model_len=args.max_model_len, kv_cache_memory_bytes=kv_bytes)


def run_workload(llm, workload: tuple[int, int, int], args, sizes: dict, hw: dict) -> dict:
    from pagedllm.benchmarks.datasets import random_requests
    from pagedllm.benchmarks.offline import run_throughput

    input_len, output_len, num_prompts = workload
    cfg = llm.llm_engine.config.model
    special = set(llm.get_tokenizer().all_special_ids)
    requests = random_requests(cfg.vocab_size, num_prompts, input_len, output_len, special_ids=special)
    res = run_throughput(llm, requests, detokenize=not args.disable_detokenize)
    elapsed = res["elapsed_time"]
    figures = {
        "output_tok_s": rounded(res["output_tokens_per_second"], 1),
        "total_tok_s": rounded(res["tokens_per_second"], 1),
        "requests_per_s": rounded(res["requests_per_second"], 2),
        "elapsed_s": rounded(elapsed, 3),
        "output_tokens": res["total_output_tokens"],
    }
    published, field = PUBLISHED.get(workload, (None, None))
    if published:
        figures |= {"vllm_published": published, "vllm_published_field": field, "vllm_source": PUBLISHED_SOURCE}
        figures["ratio"] = rounded(figures[field] / published, 3)
    min_bytes = roofline.batch_roofline_bytes(
        sizes["weight_bytes"], sizes["kv_bytes_per_token"], [r.prompt_len for r in requests], [output_len] * num_prompts
    )
    if hw["copy_bw"]:
        floor_s = min_bytes / hw["copy_bw"]
        figures |= {"roofline_frac": rounded(floor_s / elapsed, 4), "floor_s": rounded(floor_s, 3)}
        figures["roofline_output_tok_s"] = rounded(res["total_output_tokens"] / floor_s, 1)
    heads = cfg.hf_config.num_attention_heads
    flops = num_prompts * (
        roofline.linear_flops(sizes["body_params"], sizes["lm_head_params"], input_len, 1)
        + roofline.causal_attention_flops(cfg.num_layers, heads, cfg.head_dim, input_len)
    )
    figures["mfu"] = rounded(flops / elapsed / hw["peak_flops"], 4) if hw["peak_flops"] else None
    return figures | {"min_bytes": min_bytes, "input_len": input_len, "output_len": output_len}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from pagedllm import SamplingParams

    machine, commit = machine_description(), git_commit()
    cuda = torch.cuda.is_available()
    bw = copy_bandwidth() if cuda else None
    peak = args.peak_tflops * 1e12 if args.peak_tflops else roofline.dense_bf16_peak(machine.get("gpu", ""))
    with tempfile.TemporaryDirectory(prefix="vllm-workloads-") as scratch:
        t0 = time.perf_counter()
        llm = make_engine(args, scratch)
        load_s = time.perf_counter() - t0
        sizes = model_sizes(llm)
        warm = SamplingParams(max_tokens=16, ignore_eos=True)
        llm.generate([{"prompt_token_ids": [100 + i] * (50 + 40 * i)} for i in range(8)], warm, use_tqdm=False)
        common = {
            "copy_gb_s": rounded(bw / 1e9, 1) if bw else None,
            "peak_tflops": rounded(peak / 1e12, 1) if peak else None,
            "model": "tiny" if args.tiny else Path(args.model).name,
            "detokenize": not args.disable_detokenize,
            "max_model_len": llm.llm_engine.config.model.max_model_len,
            "load_s": rounded(load_s, 2),
            "weight_bytes": sizes["weight_bytes"],
            "kv_bytes_per_token": sizes["kv_bytes_per_token"],
            **(engine_figures(llm) if cuda else {"kv_cache_blocks": llm.llm_engine.core.config.cache.num_blocks}),
        }
        for workload in args.workloads:
            figures = run_workload(llm, workload, args, sizes, {"copy_bw": bw, "peak_flops": peak})
            name = "vllm-throughput-{}x{}x{}".format(*workload)
            emit(make_record(name, machine, commit, **figures, **common), append=not args.no_append)
        llm.llm_engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
