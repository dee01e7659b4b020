"""Long context on the GPU: one request at a time with a 32k-token and a 128k-token prompt (Llama-3.1-8B shapes,
dummy bf16 weights): the prefill's time and MFU, then the decode's tokens/s and MBU. One JSON line per length
(workload long-context-<length>; appended to benchmarks/results.jsonl unless --no-append).

Method. The engine: max_model_len = the longest length (131072, Llama-3.1-8B's max_position_embeddings: its llama3
rope scaling needs no more), chunked prefill with max_num_batched_tokens tokens a step (default the engine's 8192:
a 128k prompt takes 16 steps), prefix caching off, max_num_seqs 4, gpu_memory_utilization 0.9. The script checks
that the KV cache holds the longest request (128 KiB a token in bf16: 16 GiB for 128k, next to 15 GiB of weights
on an 80 GB H100) and stops with the reason when it does not. A prompt of L tokens is L random ids, cut to
max_model_len - decode tokens where L + decode tokens would pass max_model_len (128k: 130944 prompt tokens; the
record's prompt_len). A warm-up request (2 chunks + 100 tokens, 8 tokens out) compiles the kernels first.
Each length is one `generate` (greedy, ignore_eos, --decode-tokens tokens out); from its RequestOutput.metrics:
  prefill_s = first_token_time - arrival_time (all chunks of the prompt and the first token)
  decode_s  = last_token_time - first_token_time, over decode_tokens - 1 steps; decode_tok_s = steps / decode_s
  mfu = (linear FLOPs + attention FLOPs) / prefill_s / dense bf16 peak, where
        linear FLOPs    = 2 * body_params * L + 2 * lm_head_params (body: every weight but the input embedding and
                          the LM head; only the last prompt row reaches the LM head)
        attention FLOPs = 4 * layers * heads * head_dim * L * (L + 1) / 2 (causal: QK^T and PV, 2 * head_dim each
                          per query head and key)
  mfu_lm_head_all_rows: the same with the LM head counted for every prompt row (gpu_throughput.py's convention)
  mbu = sum over steps j = 1 .. decode_tokens - 1 of (step weight bytes + (L + j) * KV bytes per token)
        / decode_s / copy bandwidth; step weight bytes: every weight but the input embedding (one row is looked up)
  mbu_all_weights: the same with the input embedding counted too (gpu_throughput.py's decode-bs1 convention)
The copy bandwidth is measured in the same run (gpu_throughput.copy_bandwidth: a 4 GiB device-to-device copy,
read + write bytes). The dense bf16 peak comes from benchmarks/roofline.py's table by device name (H100 SXM and
H200: 989 TFLOP/s); --peak-tflops overrides it.

    python benchmarks/long_context.py --no-append                                # 32k and 128k, ~2 min on an H100
    python benchmarks/long_context.py --lengths 32768 --no-append
    python benchmarks/long_context.py --tiny --lengths 300,400 --decode-tokens 8 --no-append    # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

try:
    from benchmarks import roofline
    from benchmarks.cold_start import TINY
    from benchmarks.common import BENCH_DIR, emit, git_commit, machine_description, make_record, rounded
    from benchmarks.gpu_throughput import copy_bandwidth, engine_figures
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    import roofline
    from cold_start import TINY
    from common import BENCH_DIR, emit, git_commit, machine_description, make_record, rounded
    from gpu_throughput import copy_bandwidth, engine_figures


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(BENCH_DIR / "configs" / "llama-3.1-8b"), help="config folder (dummy)")
    p.add_argument("--tiny", action="store_true", help="a tiny Llama instead (CPU smoke run)")
    p.add_argument("--lengths", default="32768,131072", help="comma-separated prompt lengths")
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens generated per request")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="chunk size (default: the engine's)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="fixed KV cache (CPU: default 64 MiB)")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak (default: by device name)")
    p.add_argument("--no-append", action="store_true", help="do not append to benchmarks/results.jsonl")
    args = p.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",") if x]
    if not args.lengths or min(args.lengths) < 2:
        p.error(f"--lengths={args.lengths}: positive prompt lengths of at least 2 tokens")
    if args.decode_tokens < 2:
        p.error(f"--decode-tokens={args.decode_tokens} must be at least 2 (one decode step)")
    return args


def model_folder(args: argparse.Namespace) -> str:
    if not args.tiny:
        return args.model
    folder = Path(tempfile.mkdtemp(prefix="tiny-llama-"))
    config = dict(TINY, max_position_embeddings=max(args.lengths) + args.decode_tokens)
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return str(folder)


def make_engine(args: argparse.Namespace, max_len: int):
    from pagedllm import LLM

    cuda = torch.cuda.is_available()
    kv_bytes = args.kv_cache_memory_bytes or (None if cuda else 64 << 20)
    kwargs = dict(
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=max_len,
        max_num_seqs=4,
        enable_prefix_caching=False,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=kv_bytes,
    )
    return LLM(model_folder(args), **kwargs)


def model_sizes(llm) -> dict[str, int]:
    """Parameter counts and bytes of the model (counted on HF's model built on the meta device, so the engine's
    repacking of weights cannot hide any) and the engine's KV bytes per token (all layers, K and V)."""
    import transformers

    cfg = llm.llm_engine.config.model
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(cfg.hf_config)
    embed, lm_head = hf.get_input_embeddings().weight, hf.get_output_embeddings().weight
    tied = lm_head is embed
    num_params = sum(p.numel() for p in {id(p): p for p in hf.parameters()}.values())
    size = cfg.dtype.itemsize
    runner = llm.llm_engine.core.executor.runner
    return {
        "weight_bytes": num_params * size,
        "step_weight_bytes": (num_params - (0 if tied else embed.numel())) * size,
        "body_params": num_params - embed.numel() - (0 if tied else lm_head.numel()),
        "lm_head_params": lm_head.numel(),
        "kv_bytes_per_token": runner.kv_bytes_per_block() // runner.block_size,
    }


def check_fits(llm, need_tokens: int) -> None:
    """Stops with the reason when the KV cache cannot hold one request of need_tokens tokens."""
    cache = llm.llm_engine.core.config.cache
    holds = cache.num_blocks * cache.block_size
    if holds < need_tokens:
        raise SystemExit(
            f"the KV cache holds {holds} tokens ({cache.num_blocks} blocks of {cache.block_size}), fewer than the "
            f"{need_tokens} of the longest request: raise --gpu-memory-utilization (or --kv-cache-memory-bytes), "
            "lower --max-num-batched-tokens (less activation memory) or the length"
        )


def run_length(llm, length: int, args: argparse.Namespace, sizes: dict, hw: dict) -> dict:
    from pagedllm import SamplingParams
    from pagedllm.benchmarks.offline import timed_generate

    cfg = llm.llm_engine.config.model
    prompt_len = min(length, cfg.max_model_len - args.decode_tokens)
    rng = random.Random(length)
    prompt = [rng.randrange(cfg.vocab_size) for _ in range(prompt_len)]
    params = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    (out,), wall = timed_generate(llm, [{"prompt_token_ids": prompt}], params)
    m, made = out.metrics, len(out.outputs[0].token_ids)
    prefill_s, decode_s, steps = m.first_token_time - m.arrival_time, m.last_token_time - m.first_token_time, made - 1
    hf = cfg.hf_config
    attn = roofline.causal_attention_flops(cfg.num_layers, hf.num_attention_heads, cfg.head_dim, prompt_len)
    lin = roofline.linear_flops(sizes["body_params"], sizes["lm_head_params"], prompt_len, 1)
    lin_all = roofline.linear_flops(sizes["body_params"], sizes["lm_head_params"], prompt_len, prompt_len)
    kv = sizes["kv_bytes_per_token"]
    read = roofline.decode_bytes(sizes["step_weight_bytes"], kv, prompt_len, steps)
    read_all = roofline.decode_bytes(sizes["weight_bytes"], kv, prompt_len, steps)
    peak, bw = hw["peak_flops"], hw["copy_bw"]
    frac = lambda num, den: rounded(num / den, 4) if den else None  # noqa: E731
    return {
        "prompt_len": prompt_len,
        "decode_tokens": made,
        "prefill_s": rounded(prefill_s, 4),
        "prefill_tok_s": rounded(prompt_len / prefill_s, 1),
        "mfu": frac((lin + attn) / prefill_s, peak),
        "mfu_lm_head_all_rows": frac((lin_all + attn) / prefill_s, peak),
        "prefill_tflops": rounded((lin + attn) / prefill_s / 1e12, 1),
        "attention_flops": attn,
        "linear_flops": lin,
        "decode_s": rounded(decode_s, 4),
        "decode_tok_s": rounded(steps / decode_s, 2),
        "mbu": frac(read / decode_s, bw),
        "mbu_all_weights": frac(read_all / decode_s, bw),
        "decode_bytes_per_step": read // steps,
        "wall_s": rounded(wall, 3),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from pagedllm import SamplingParams

    machine, commit = machine_description(), git_commit()
    cuda = torch.cuda.is_available()
    bw = copy_bandwidth() if cuda else None
    peak = args.peak_tflops * 1e12 if args.peak_tflops else roofline.dense_bf16_peak(machine.get("gpu", ""))
    hw = {"copy_bw": bw, "peak_flops": peak}
    max_len = max(args.lengths)
    t0 = time.perf_counter()
    llm = make_engine(args, max_len)
    load_s = time.perf_counter() - t0
    check_fits(llm, max_len)
    sizes = model_sizes(llm)
    sched = llm.llm_engine.core.config.scheduler
    warm_len = min(max_len - 8, 2 * sched.max_num_batched_tokens + 100)
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [7] * warm_len}], warm, use_tqdm=False)
    common = {
        "copy_gb_s": rounded(bw / 1e9, 1) if bw else None,
        "peak_tflops": rounded(peak / 1e12, 1) if peak else None,
        "peak_source": "--peak-tflops" if args.peak_tflops else "benchmarks/roofline.py table by device name",
        "max_model_len": llm.llm_engine.config.model.max_model_len,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "model": "tiny" if args.tiny else Path(args.model).name,
        "load_s": rounded(load_s, 2),
        **{k: sizes[k] for k in ("weight_bytes", "step_weight_bytes", "kv_bytes_per_token")},
        **(engine_figures(llm) if cuda else {"kv_cache_blocks": llm.llm_engine.core.config.cache.num_blocks}),
    }
    for length in args.lengths:
        figures = run_length(llm, length, args, sizes, hw)
        emit(make_record(f"long-context-{length}", machine, commit, **figures, **common), append=not args.no_append)
    llm.llm_engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
