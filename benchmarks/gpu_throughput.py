"""GPU throughput of pagedllm (Triton attention, CUDA graphs) with HF transformers measured in the same run.

Workloads, each one JSON line on stdout (appended to benchmarks/results.jsonl unless --no-append):
  nanovllm-bench          nano-vllm's bench.py exactly: random.seed(0); 256 sequences; prompt ids randint(0, 10000)
                          of length randint(100, 1024); max_tokens randint(100, 1024); temperature 0.6, ignore_eos;
                          max_model_len 4096; throughput = sum(max_tokens) / wall time. Qwen3-0.6B shapes, dummy
                          weights. roofline_frac = floor_time / wall time, floor_time = min_bytes / copy bandwidth,
                          min_bytes = weight_bytes * max_i(max_tokens_i)
                                      + sum_i sum_{t < max_tokens_i} (prompt_len_i + t) * kv_bytes_per_token
  nanovllm-bench-vs-hf    the same prompts through HF `generate` (bf16, static left-padded batches); only each
                          sequence's own max_tokens count. --hf-prompts limits HF to the first N prompts (per-token
                          throughput; the record says how many)
  decode-bs1-llama-3.1-8b one request, 128-token prompt, 512 output tokens, timed after an untimed run of the same
                          shape; mbu = bytes of weights + KV read per step / step time / copy bandwidth
  prefill-llama-3.1-8b    32 prompts x 4096 tokens, 1 output token; mfu = 2 * params * tokens / time / 989e12
                          (params without the input embedding); HF's SDPA forward on the same prompts too
  cold-start              a fresh interpreter: LLM() to the first token, Qwen3-0.6B dummy (graph capture included)
The copy bandwidth is a device-to-device copy of a 4 GiB tensor, counting bytes read and written.
--quantization fp8 runs pagedllm's engines with quantization="fp8" (the dummy bf16 weights quantized per channel at
load, activations per token, cuBLASLt's FP8 GEMM); weight_bytes and the roofline figures then count the fp8 weights.
--quantization w4a16-gptq | w4a16-awq | w4a16-ct | w8a16-gptq gives pagedllm's engines a copy of the config with the
format's quantization_config (group size 128; WEIGHT_ONLY below) and dummy weights in that format (random packed
ints, the Triton dequant-GEMM); weight_bytes then counts the packed weights and their scales.
--kv-cache-dtype fp8 (fp8_e4m3, fp8_e5m2) stores pagedllm's KV cache in FP8 (scales 1.0 with dummy weights): the
records' kv_cache_blocks double and kv_bytes_per_token halves.
The HF peers stay bf16. Compare with a run without the flag on the same machine.
--tensor-parallel-size / --pipeline-parallel-size spread pagedllm's engines over that many GPUs (the HF peers use
one); weight_bytes and the roofline figures are then the first rank's shard against one GPU's bandwidth. Compare
with a run at 1 on the same machine. --nano-config llama-3.1-8b (or llama-3.1-70b) runs
nanovllm-bench (and its HF peer) on Llama-3.1-8B (70B) shapes instead of Qwen3-0.6B's; --llama-config llama-3.1-70b
runs the decode-bs1 and prefill workloads on Llama-3.1-70B shapes (the records say `llama_config`; the workload
names keep "llama-3.1-8b").

    python benchmarks/gpu_throughput.py --no-append
    python benchmarks/gpu_throughput.py --num-seqs 32 --hf-prompts 8 --prefill-prompts 4 --no-append   # smoke
    python benchmarks/gpu_throughput.py --workloads nanovllm-bench,decode-bs1-llama-3.1-8b --quantization fp8 \
        --nano-config llama-3.1-8b
    python benchmarks/gpu_throughput.py --workloads decode-bs1-llama-3.1-8b,prefill-llama-3.1-8b \
        --quantization w4a16-gptq
    python benchmarks/gpu_throughput.py --workloads nanovllm-bench,decode-bs1-llama-3.1-8b --kv-cache-dtype fp8
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pagedllm.benchmarks.offline import timed_generate

try:
    from benchmarks import hf_peers, roofline
    from benchmarks.common import BENCH_DIR, REPO_ROOT, emit, git_commit, machine_description, make_record, rounded
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    import hf_peers
    import roofline
    from common import BENCH_DIR, REPO_ROOT, emit, git_commit, machine_description, make_record, rounded

QWEN = str(BENCH_DIR / "configs" / "qwen3-0.6b")
LLAMA_CONFIGS = ("llama-3.1-8b", "llama-3.1-70b")  # --llama-config: the shapes of the decode and prefill workloads
PEAK_BF16_FLOPS = 989e12  # H100 / H200 dense bf16
# weight-only integer formats: the quantization_config a copy of the model's config.json gets (dummy weights)
WEIGHT_ONLY = {
    "w4a16-gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
    "w4a16-awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "w4a16-ct": {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True},
            }
        },
        "ignore": ["lm_head"],
    },
    "w8a16-gptq": {"quant_method": "gptq", "bits": 8, "group_size": 128, "desc_act": False, "sym": True},
}
WORKLOADS = ("cold-start", "nanovllm-bench", "nanovllm-bench-vs-hf", "decode-bs1-llama-3.1-8b", "prefill-llama-3.1-8b")
COLD_START_CODE = """
import json, time
t0 = time.perf_counter()
from pagedllm import LLM, SamplingParams
llm = LLM({model!r}, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096, quantization={quant!r})
llm.generate([{{"prompt_token_ids": [1, 2, 3]}}], SamplingParams(max_tokens=1), use_tqdm=False)
graphs = llm.llm_engine.core.executor.runner.graphs
print(json.dumps({{"seconds": time.perf_counter() - t0, "capture_seconds": graphs.capture_seconds if graphs else 0}}))
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of the workloads")
    p.add_argument("--num-seqs", type=int, default=256, help="nanovllm-bench sequences (256 = the workload)")
    p.add_argument("--hf-prompts", type=int, default=64, help="HF runs the first N prompts (default 64)")
    p.add_argument("--hf-batch-sizes", default="64", help="HF batch sizes to try, best taken (default 64)")
    p.add_argument("--prefill-prompts", type=int, default=32, help="prefill workload prompts (32 = the workload)")
    p.add_argument("--hf-prefill-batch", type=int, default=4, help="HF prefill forward batch size")
    p.add_argument("--enforce-eager", action="store_true", help="pagedllm without CUDA graphs")
    p.add_argument(
        "--async-scheduling",
        choices=("auto", "on", "off"),
        default="auto",
        help="pagedllm's async_scheduling (auto: on, the CUDA default)",
    )
    p.add_argument(
        "--quantization",
        choices=("none", "fp8", *WEIGHT_ONLY),
        default="none",
        help="pagedllm's quantization of the dummy weights at load (none: bf16)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
        default="auto",
        help="pagedllm's kv_cache_dtype (auto: the model's dtype)",
    )
    p.add_argument(
        "--nano-config",
        choices=("qwen3-0.6b", *LLAMA_CONFIGS),
        default="qwen3-0.6b",
        help="the model shapes of nanovllm-bench (default: Qwen3-0.6B, as nano-vllm's bench.py)",
    )
    p.add_argument("--llama-config", choices=LLAMA_CONFIGS, default="llama-3.1-8b", help="decode/prefill shapes")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="pagedllm's GPUs per stage")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="pagedllm's pipeline stages")
    p.add_argument("--disable-custom-all-reduce", action="store_true", help="TP all-reduces all through NCCL")
    p.add_argument("--no-append", action="store_true", help="do not append to benchmarks/results.jsonl")
    args = p.parse_args(argv)
    args.nano_model = str(BENCH_DIR / "configs" / args.nano_config)
    args.workloads = [w for w in args.workloads.split(",") if w]
    unknown = set(args.workloads) - set(WORKLOADS)
    if unknown:
        p.error(f"unknown workloads {sorted(unknown)}; known: {WORKLOADS}")
    args.hf_batch_sizes = [int(b) for b in args.hf_batch_sizes.split(",")]
    args.engine_options = {
        "enforce_eager": args.enforce_eager,
        "async_scheduling": {"auto": None, "on": True, "off": False}[args.async_scheduling],
        "quantization": quantization_name(args.quantization),
        "tensor_parallel_size": args.tensor_parallel_size,
        "pipeline_parallel_size": args.pipeline_parallel_size,
        "kv_cache_dtype": args.kv_cache_dtype,
        "disable_custom_all_reduce": args.disable_custom_all_reduce,
    }
    return args


def quantization_name(choice: str) -> str | None:
    """The `quantization=` pagedllm's engines get for a --quantization choice."""
    if choice in WEIGHT_ONLY:
        return WEIGHT_ONLY[choice]["quant_method"]
    return None if choice == "none" else choice


def engine_model(path: str, choice: str) -> str:
    """The model folder pagedllm loads: `path`, or for a weight-only format a copy of its config.json with the
    format's quantization_config (the HF peers keep loading `path`)."""
    if choice not in WEIGHT_ONLY:
        return path
    config = json.loads((Path(path) / "config.json").read_text())
    config["quantization_config"] = WEIGHT_ONLY[choice]
    folder = Path(tempfile.mkdtemp(prefix=f"{choice}-"))
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def copy_bandwidth(nbytes: int = 4 << 30, iters: int = 10) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read and written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")  # [nbytes]
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes * iters / seconds


def nano_workload(num_seqs: int) -> tuple[list[list[int]], list[int]]:
    """nano-vllm bench.py's draws, in its order."""
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(num_seqs)]
    max_tokens = [random.randint(100, 1024) for _ in range(num_seqs)]
    return prompts, max_tokens


def model_bytes(llm) -> tuple[int, int, int]:
    """(weight bytes, parameters without the input embedding, KV bytes per token) of the engine's model (with
    tensor/pipeline parallelism: of the first rank's shard, which the roofline of one GPU's bandwidth reads)."""
    runner = llm.llm_engine.core.executor.runner
    params = {id(p): p for p in runner.model.parameters()}.values()  # a tied LM head counted once
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    embed = runner.model.model.embed_tokens.weight
    lm_head = runner.model.lm_head.weight
    num_params = sum(p.numel() for p in params) - (embed.numel() if lm_head is not embed else 0)
    return weight_bytes, num_params, runner.kv_bytes_per_block() // runner.block_size


def engine_figures(llm) -> dict:
    runner = llm.llm_engine.core.executor.runner
    prof = runner.memory_profile or {}
    gib = lambda key: rounded(prof[key] / 2**30, 3) if key in prof else None  # noqa: E731
    return {
        "kv_cache_blocks": llm.llm_engine.core.config.cache.num_blocks,
        "kv_cache_gib": gib("kv_cache_bytes"),
        "weights_gib": gib("weights_bytes"),
        "peak_activation_gib": gib("peak_activation_bytes"),
        "graph_reserve_gib": gib("graph_reserve_bytes"),
        "graph_capture_s": rounded(runner.graphs.capture_seconds, 3) if runner.graphs else None,
        "cuda_graphs": runner.graphs is not None,
    }


def free() -> None:
    """After the caller dropped its engine or model: return its GPU memory before the next one loads."""
    gc.collect()
    torch.cuda.empty_cache()


def run_nano(args, bw: float, prompts, max_tokens) -> dict:
    from pagedllm import LLM, SamplingParams

    t0 = time.perf_counter()
    model = engine_model(args.nano_model, args.quantization)
    llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096, **args.engine_options)
    load_s = time.perf_counter() - t0
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(), use_tqdm=False)  # bench.py's warm-up
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    torch.cuda.reset_peak_memory_stats()
    outs, wall = timed_generate(llm, [{"prompt_token_ids": p} for p in prompts], params)
    made = sum(len(o.outputs[0].token_ids) for o in outs)
    weight_bytes, _, kv_per_token = model_bytes(llm)
    stages = args.pipeline_parallel_size  # (each stage's weights read once per micro-batch: see roofline.py)
    min_bytes = roofline.batch_roofline_bytes(weight_bytes, kv_per_token, [len(p) for p in prompts], max_tokens, stages)
    floor_s = min_bytes / bw
    figures = {
        "output_tok_s": rounded(sum(max_tokens) / wall),
        "roofline_frac": rounded(floor_s / wall, 4),
        "wall_s": rounded(wall, 3),
        "floor_s": rounded(floor_s, 3),
        "roofline_tok_s": rounded(sum(max_tokens) / floor_s),
        "min_bytes": min_bytes,
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_per_token,
        "num_seqs": len(prompts),
        "output_tokens": sum(max_tokens),
        "output_tokens_made": made,
        "peak_allocated_gib": rounded(torch.cuda.max_memory_allocated() / 2**30, 3),
        "load_s": rounded(load_s, 3),
        **engine_figures(llm),
    }
    llm.llm_engine.shutdown()
    del llm
    free()
    return figures


def run_nano_hf(args, ours_tok_s: float | None, prompts, max_tokens) -> dict:
    model = hf_peers.load_model(args.nano_model)
    n = min(args.hf_prompts, len(prompts))
    hf_peers.generate_tok_s(model, prompts[:2], [4, 4], 2, 0.6)  # warm-up
    by_batch = {}
    for bs in args.hf_batch_sizes:
        tok_s, secs, useful = hf_peers.generate_tok_s(model, prompts[:n], max_tokens[:n], bs, 0.6)
        by_batch[bs] = (tok_s, secs, useful)
    del model
    free()
    best = max(by_batch, key=lambda b: by_batch[b][0])
    return {
        "ratio": rounded(ours_tok_s / by_batch[best][0], 3) if ours_tok_s else None,
        "pagedllm_tok_s": ours_tok_s,
        "hf_tok_s": rounded(by_batch[best][0]),
        "hf_best_batch": best,
        "hf_tok_s_by_batch": {str(b): rounded(v[0]) for b, v in by_batch.items()},
        "hf_prompts": n,
        "hf_seconds": rounded(by_batch[best][1], 2),
        "hf_output_tokens": by_batch[best][2],
        "note": f"HF on the first {n} of the {len(prompts)} prompts (static batches; only each sequence's own "
        "max_tokens counted); pagedllm on all of them",
    }


def run_llama(args, bw: float, workloads: list[str]) -> dict[str, dict]:
    from pagedllm import LLM, SamplingParams

    model = engine_model(str(BENCH_DIR / "configs" / args.llama_config), args.quantization)
    llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, max_model_len=8192, **args.engine_options)
    weight_bytes, num_params, kv_per_token = model_bytes(llm)
    rng = random.Random(1)
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [1] * 200}, {"prompt_token_ids": [2] * 300}], warm, use_tqdm=False)
    out: dict[str, dict] = {}
    if "decode-bs1-llama-3.1-8b" in workloads:
        prompt = [rng.randint(0, 100000) for _ in range(128)]
        params = SamplingParams(temperature=0, max_tokens=512, ignore_eos=True)
        # a whole untimed run first (after the short warm-up alone, the first run on a fresh machine read 14% below
        # the runs after it)
        llm.generate([{"prompt_token_ids": [rng.randint(0, 100000) for _ in range(128)]}], params, use_tqdm=False)
        _, wall = timed_generate(llm, [{"prompt_token_ids": prompt}], params)
        step_bytes = sum(weight_bytes + (128 + t) * kv_per_token for t in range(512))
        out["decode-bs1-llama-3.1-8b"] = {
            "tok_s": rounded(512 / wall),
            "mbu": rounded(step_bytes / wall / bw, 4),
            "wall_s": rounded(wall, 3),
            "weight_bytes": weight_bytes,
            **engine_figures(llm),
        }
    if "prefill-llama-3.1-8b" in workloads:
        prompts = [[rng.randint(0, 100000) for _ in range(4096)] for _ in range(args.prefill_prompts)]
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        _, wall = timed_generate(llm, [{"prompt_token_ids": p} for p in prompts], params)
        tokens = 4096 * len(prompts)
        out["prefill-llama-3.1-8b"] = {
            "tok_s": rounded(tokens / wall),
            "mfu": rounded(2 * num_params * tokens / wall / PEAK_BF16_FLOPS, 4),
            "wall_s": rounded(wall, 3),
            "num_prompts": len(prompts),
            "params": num_params,
            "max_num_batched_tokens": llm.llm_engine.core.config.scheduler.max_num_batched_tokens,
        }
        llm.llm_engine.shutdown()
        del llm
        free()
        model = hf_peers.load_model(str(BENCH_DIR / "configs" / args.llama_config))
        hf_tok_s, hf_s = hf_peers.prefill_tok_s(model, prompts, args.hf_prefill_batch)
        out["prefill-llama-3.1-8b"].update(
            hf_tok_s=rounded(hf_tok_s),
            hf_mfu=rounded(2 * num_params * hf_tok_s / PEAK_BF16_FLOPS, 4),
            hf_batch=args.hf_prefill_batch,
            ratio=rounded(tokens / wall / hf_tok_s, 3),
        )
        del model
        free()
    return out


def cold_start(choice: str) -> dict:
    """LLM() to the first token in a fresh interpreter (run twice: the first also fills the Triton cache)."""
    runs = []
    model = engine_model(QWEN, choice)
    for _ in range(2):
        code = COLD_START_CODE.format(model=model, quant=quantization_name(choice))
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"cold-start subprocess failed:\n{proc.stderr[-4000:]}")
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return {
        "seconds_first": rounded(runs[0]["seconds"], 3),
        "seconds": rounded(runs[1]["seconds"], 3),
        "graph_capture_s": rounded(runs[1]["capture_seconds"], 3),
        "includes": "import pagedllm, LLM(), one 1-token generate",
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_throughput.py needs a CUDA GPU")
    machine, commit = machine_description(), git_commit()
    bw = copy_bandwidth()
    common = {"copy_gb_s": rounded(bw / 1e9, 1)}
    records: dict[str, dict] = {}

    def record(workload: str, figures: dict) -> None:  # emitted at once: a later failure keeps earlier lines
        records[workload] = figures
        figures = {
            **figures,
            **common,
            "enforce_eager": args.enforce_eager,
            "async_scheduling": args.async_scheduling,
            "quantization": args.quantization,
            "tensor_parallel_size": args.tensor_parallel_size,
            "pipeline_parallel_size": args.pipeline_parallel_size,
            "kv_cache_dtype": args.kv_cache_dtype,
            "custom_all_reduce": not args.disable_custom_all_reduce,
            **({"nano_config": args.nano_config} if workload.startswith("nanovllm") else {}),
            **({"llama_config": args.llama_config} if workload.endswith("llama-3.1-8b") else {}),
        }
        emit(make_record(workload, machine, commit, **figures), append=not args.no_append)

    if "cold-start" in args.workloads:
        record("cold-start", cold_start(args.quantization))
    prompts, max_tokens = nano_workload(args.num_seqs)
    if "nanovllm-bench" in args.workloads:
        record("nanovllm-bench", run_nano(args, bw, prompts, max_tokens))
    if "nanovllm-bench-vs-hf" in args.workloads:
        ours = records.get("nanovllm-bench", {}).get("output_tok_s")
        record("nanovllm-bench-vs-hf", run_nano_hf(args, ours, prompts, max_tokens))
    llama = [w for w in args.workloads if w.endswith("llama-3.1-8b")]
    if llama:
        for workload, figures in run_llama(args, bw, llama).items():
            record(workload, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
