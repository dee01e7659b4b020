"""Paged attention on the GPU: the Triton backend's forward against the torch backend's on the same step.

Workloads (Qwen3-0.6B attention shapes by default: 16 query heads, 8 KV heads, head_dim 128, bf16, block 16):
  decode-64x1024   64 decodes over 1024-token contexts (KV read bound: figure is GB/s of K/V read)
  decode-4x8192    4 decodes over 8192-token contexts (split-K's case), with split-K forced off for comparison
  tp1-decode-256-mixed[-split4|-split8], tp2-...   256 decodes over 100..2047-token contexts, Llama-3.1-8B's heads
      per rank at TP=1 / TP=2, default splits or forced
  prefill-2048     one 2048-token prefill chunk after 2048 cached tokens (compute bound: figure is TFLOP/s)
At its limit, Llama-3.1-8B attention shapes (32 query heads, 8 KV heads, head_dim 128, bf16):
  limit-decode-256x1024, limit-decode-32x8192, limit-decode-1x131072   decodes over 1k / 8k / 128k contexts:
      kv_read_frac_of_copy = bytes of K/V read (every context token's K and V, all KV heads) / time / the copy
      bandwidth measured in the same run (gpu_throughput.copy_bandwidth: a 4 GiB device copy, read + write bytes);
      goal >= 0.85
  limit-prefill-8192   one 8192-token prompt (no cache before it): tflops = causal attention FLOPs
      4 * heads * head_dim * n * (n + 1) / 2 / time, and frac_of_peak = that / the dense bf16 peak
      (benchmarks/roofline.py's table by device name, 989 TFLOP/s on an H100 SXM; --peak-tflops); goal >= 0.5
Each forward includes the KV-cache write of the step's new tokens; metadata is built once, outside the timing.
Times are CUDA-event medians over --iters after --warmup, of CUDA-graph replays (no Python launch overhead;
eager where capture fails). One JSON line per workload (appended to benchmarks/results.jsonl unless --no-append).
Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here) with wall-clock times: a
smoke run only, with --shrink dividing every context length and batch size (tests/kernels/
test_attention_bench_smoke.py runs it so, with the interpreter fixes of tests/kernels/conftest.py).
    python benchmarks/attention_kernels.py --no-append                               # all, ~1 min on an H100
    python benchmarks/attention_kernels.py --workloads limit-decode-1x131072,limit-prefill-8192 --no-append
--kv-cache-dtype fp8 runs every workload over an E4M3 cache (K/V bytes and GB/s count one byte a value).
--sweep times the prefill tile configs of SWEEP_GRID (triton_backend.PREFILL_TILES entries: BLOCK_M rows, BLOCK_N,
warps, stages) on SWEEP_WORKLOADS instead (compiled in parallel first; a config over the shared memory is skipped),
one line per config, then the fastest as a line for PREFILL_TILES:
    python benchmarks/attention_kernels.py --sweep --no-append                       # 2 x 36 configs + default
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

if not torch.cuda.is_available():  # read when the kernels are decorated, so before pagedllm.attention's import
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagedllm.attention import torch_backend, triton_backend  # noqa: E402
from pagedllm.attention.common import BatchLayout  # noqa: E402

try:
    from benchmarks import roofline
    from benchmarks.common import emit, git_commit, machine_description, make_record, rounded
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    import roofline
    from common import emit, git_commit, machine_description, make_record, rounded

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
LLAMA_8B = (32, 8)  # query heads, KV heads of Llama-3.1-8B (head_dim 128)
# name -> ([(context_len, query_len)] per request, forced num_splits or None, (heads, kv_heads) or None: the flags')
WORKLOADS = {
    "decode-64x1024": ([(1023, 1)] * 64, None, None),
    "decode-256x1024": ([(1023, 1)] * 256, None, None),
    "decode-32x2048": ([(2047, 1)] * 32, None, None),
    "decode-4x8192": ([(8191, 1)] * 4, None, None),
    "decode-4x8192-nosplit": ([(8191, 1)] * 4, 1, None),
    "prefill-2048-after-2048": ([(2048, 2048)], None, None),
    "mixed-32dec-1prefill512": ([(1023, 1)] * 32 + [(0, 512)], None, None),
    "limit-decode-256x1024": ([(1023, 1)] * 256, None, LLAMA_8B),
    "limit-decode-32x8192": ([(8191, 1)] * 32, None, LLAMA_8B),
    "limit-decode-1x131072": ([(131071, 1)], None, LLAMA_8B),
    "limit-prefill-8192": ([(0, 8192)], None, LLAMA_8B),
}
# nanovllm-bench's decode batches: 256 contexts of 100..2047 tokens, per rank at TP=1 and TP=2 (Llama-3.1-8B's heads
# halved), by the default split rule and with the key ranges forced into 4 or 8 splits (long contexts in several
# programs: does the spread of lengths leave the last wave's SMs idle?)
MIXED = [(int(c), 1) for c in np.random.default_rng(0).integers(100, 2048, 256)]
WORKLOADS.update(
    {
        f"tp{tp}-decode-256-mixed" + (f"-split{splits}" if splits else ""): (MIXED, splits, heads)
        for tp, heads in ((1, LLAMA_8B), (2, (16, 4)))
        for splits in (None, 4, 8)
    }
)
DECODE_GOAL, PREFILL_GOAL = 0.85, 0.5  # of the copy bandwidth, of the dense bf16 peak
SWEEP_WORKLOADS = ("limit-prefill-8192", "prefill-2048-after-2048")
# (BLOCK_M rows, BLOCK_N, num_warps, num_stages): BLOCK_Q = rows // group, 16 / 32 query tokens at group 4
SWEEP_GRID = [(m, n, w, st) for m in (64, 128) for n in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of the workloads")
    p.add_argument("--shrink", type=int, default=1, help="divide context lengths and batch sizes (smoke runs)")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak (default: by device name)")
    p.add_argument("--no-append", action="store_true", help="do not append to benchmarks/results.jsonl")
    p.add_argument("--sweep", action="store_true", help="time the prefill tile configs of SWEEP_GRID instead")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto", help="fp8: an E4M3 cache (scales 1)")
    args = p.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    unknown = set(args.workloads) - set(WORKLOADS)
    if unknown:
        p.error(f"unknown workloads {sorted(unknown)}; known: {list(WORKLOADS)}")
    if args.shrink < 1:
        p.error(f"--shrink={args.shrink} must be at least 1")
    return args


def shrunk(reqs: list[tuple[int, int]], k: int) -> list[tuple[int, int]]:
    """The requests with 1/k of the batch and of each context (decodes keep their one query token)."""
    if k == 1:
        return reqs
    keep = reqs[: max(1, len(reqs) // k)]
    return [(c // k, n if n == 1 else max(1, n // k)) for c, n in keep]


def make_step(reqs, args, dtype=torch.bfloat16):
    """[(context_len, query_len)] -> (q, k, v, kv_cache, layout) on the device, blocks given out shuffled."""
    dev, bs = DEVICE, args.block_size
    nbs = [-(-(c + n) // bs) for c, n in reqs]
    perm = np.random.default_rng(0).permutation(sum(nbs))
    table = np.zeros((len(reqs), max(nbs)), dtype=np.int64)  # [num_reqs, max_blocks]
    slots, used = [], 0
    for i, ((c, n), nb) in enumerate(zip(reqs, nbs)):
        table[i, :nb] = perm[used : used + nb]
        used += nb
        pos = np.arange(c, c + n)
        slots.append(table[i, pos // bs] * bs + pos % bs)
    qsl = np.concatenate([[0], np.cumsum([n for _, n in reqs])]).astype(np.int64)  # [num_reqs + 1]
    seq_lens = np.array([c + n for c, n in reqs], dtype=np.int64)  # [num_reqs]
    num_tokens = int(qsl[-1])
    kv_cache = torch.randn(2, sum(nbs), bs, args.kv_heads, args.head_dim, device=dev, dtype=dtype)
    q = torch.randn(num_tokens, args.heads, args.head_dim, device=dev, dtype=dtype)  # [num_tokens, heads, dim]
    k = torch.randn(num_tokens, args.kv_heads, args.head_dim, device=dev, dtype=dtype)  # [num_tokens, kv_heads, dim]
    v = torch.randn_like(k)
    slot_mapping = torch.from_numpy(np.concatenate(slots)).to(dev)  # [num_tokens]
    return q, k, v, kv_cache, BatchLayout(qsl, seq_lens, table, slot_mapping, bs, dev)


def time_ms(fn, iters: int, warmup: int) -> float:
    """Median GPU time of one call, replayed from a CUDA graph (so Python launch overhead, which CUDA graphs remove
    in the engine, is not counted); eagerly timed where capture fails; wall-clock on the CPU (smoke runs)."""
    for _ in range(warmup):
        fn()
    if DEVICE.type != "cuda":
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    except RuntimeError:
        torch.cuda.synchronize()
        run = fn
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@torch.inference_mode()
def run_workload(name: str, reqs, args, num_splits: int | None = None) -> dict:
    q, k, v, kv_cache, layout = make_step(reqs, args)
    ref_cache = kv_cache
    if args.kv_cache_dtype == "fp8":  # (scales 1.0: randn values lie well inside E4M3's range)
        ref_cache = kv_cache.to(torch.float8_e4m3fn).to(q.dtype)
        kv_cache = triton_backend.slot_major_to_cache(kv_cache.to(torch.float8_e4m3fn))  # (V transposed per block)
    scale = args.head_dim**-0.5
    t_meta = triton_backend.build_metadata(layout)
    t_meta.num_splits = num_splits
    r_meta = torch_backend.build_metadata(layout)
    out_t = triton_backend.forward(q, k, v, kv_cache, t_meta, scale)
    r_cache = torch_backend.from_slot_major(ref_cache)
    out_r = torch_backend.forward(q, k, v, r_cache, r_meta, scale)
    max_err = (out_t.float() - out_r.float()).abs().max().item()
    del out_t, out_r
    triton_ms = time_ms(lambda: triton_backend.forward(q, k, v, kv_cache, t_meta, scale), args.iters, args.warmup)
    torch_ms = time_ms(lambda: torch_backend.forward(q, k, v, r_cache, r_meta, scale), args.iters, args.warmup)
    kv_bytes = sum(c + n for c, n in reqs) * args.kv_heads * args.head_dim * 2 * kv_cache.element_size()
    flops = sum(roofline.causal_attention_flops(1, args.heads, args.head_dim, n, c) for c, n in reqs)
    return dict(
        workload=f"attention-{name}" + ("-fp8-cache" if args.kv_cache_dtype == "fp8" else ""),
        triton_ms=rounded(triton_ms, 4),
        torch_ms=rounded(torch_ms, 4),
        speedup=rounded(torch_ms / triton_ms, 2),
        triton_kv_read_gbps=rounded(kv_bytes / triton_ms / 1e6, 1),
        triton_tflops=rounded(flops / triton_ms / 1e9, 2),
        max_abs_diff=rounded(max_err, 4),
        num_splits="auto" if num_splits is None else num_splits,
        kv_bytes=kv_bytes,
        flops=flops,
    )


def limit_figures(name: str, fig: dict, copy_bw: float | None, peak: float | None) -> dict:
    """The at-its-limit fractions: decode K/V read bandwidth of the copy bandwidth, prefill TFLOP/s of the peak."""
    if name.startswith("limit-decode"):
        gbps = fig["triton_kv_read_gbps"]
        frac = rounded(gbps * 1e9 / copy_bw, 4) if copy_bw else None
        return {"kv_read_frac_of_copy": frac, "goal": DECODE_GOAL}
    if name.startswith("limit-prefill"):
        frac = rounded(fig["triton_tflops"] * 1e12 / peak, 4) if peak else None
        return {"frac_of_peak": frac, "goal": PREFILL_GOAL}
    return {}


def device_limits(args, machine: dict) -> tuple[float | None, float | None]:
    """(copy bandwidth in bytes/s, dense bf16 peak FLOP/s) of the device; None where unknown (the CPU)."""
    peak = args.peak_tflops * 1e12 if args.peak_tflops else roofline.dense_bf16_peak(machine.get("gpu", ""))
    if DEVICE.type != "cuda":
        return None, peak
    try:
        from benchmarks.gpu_throughput import copy_bandwidth
    except ImportError:  # run as a script
        from gpu_throughput import copy_bandwidth
    return copy_bandwidth(), peak


def workload_args(name: str, args) -> argparse.Namespace:
    """The flags with the workload's own head counts, where it has them."""
    wargs = argparse.Namespace(**vars(args))
    if WORKLOADS[name][2] is not None:
        wargs.heads, wargs.kv_heads = WORKLOADS[name][2]
    return wargs


def precompile(calls) -> None:
    """Compiles the Triton specializations that calls launch on a thread pool (each launch recorded and skipped),
    so that the sweep does not compile its configs one after another; whatever fails here compiles at launch."""
    import triton

    if DEVICE.type != "cuda" or not hasattr(triton, "AsyncCompileMode"):
        return
    from concurrent.futures import ThreadPoolExecutor

    from pagedllm.worker.kernel_warmup import record_specializations

    with ThreadPoolExecutor(os.cpu_count() or 4) as pool, triton.AsyncCompileMode(pool, ignore_errors=True):
        for call in calls:
            for fn, data in record_specializations(call):
                try:
                    fn.preload(data)
                except Exception:  # noqa: BLE001 (it compiles, and reports, at its launch)
                    pass


@torch.inference_mode()
def sweep_workload(name: str, args, peak: float | None) -> dict:
    """Times every SWEEP_GRID config on the workload (one printed line each, checked against the torch backend)
    after the default tiles and torch's; returns the summary with the fastest config."""
    wargs = workload_args(name, args)
    reqs = shrunk(WORKLOADS[name][0], args.shrink)
    q, k, v, kv_cache, layout = make_step(reqs, wargs)
    scale, dim_pad = wargs.head_dim**-0.5, max(16, triton_backend.triton_next_pow2(wargs.head_dim))
    meta, r_meta = triton_backend.build_metadata(layout), torch_backend.build_metadata(layout)
    r_cache = torch_backend.from_slot_major(kv_cache)
    ref = torch_backend.forward(q, k, v, r_cache, r_meta, scale).float()
    flops = sum(roofline.causal_attention_flops(1, wargs.heads, wargs.head_dim, n, c) for c, n in reqs)
    torch_ms = time_ms(lambda: torch_backend.forward(q, k, v, r_cache, r_meta, scale), args.iters, args.warmup)
    saved = dict(triton_backend.PREFILL_TILES)

    def forward_with(cfg):
        triton_backend.PREFILL_TILES.clear()
        triton_backend.PREFILL_TILES.update({dim_pad: cfg} if cfg else saved)
        return triton_backend.forward(q, k, v, kv_cache, meta, scale)

    t0 = time.perf_counter()
    precompile([lambda cfg=cfg: forward_with(cfg) for cfg in [None, *SWEEP_GRID]])
    compile_s = time.perf_counter() - t0
    rows = []
    try:
        for cfg in [None, *SWEEP_GRID]:
            rows.append((cfg, *time_config(lambda cfg=cfg: forward_with(cfg), ref, args)))
            print_config(name, cfg, rows[-1][1:], flops, peak, wargs.heads // wargs.kv_heads)
    finally:
        triton_backend.PREFILL_TILES.clear()
        triton_backend.PREFILL_TILES.update(saved)
    timed = [r for r in rows[1:] if r[1] is not None]
    best = min(timed, key=lambda r: r[1]) if timed else (None, None, None)
    tflops = {cfg: flops / ms / 1e9 if ms else None for cfg, ms, _ in rows}
    if best[0] is not None:
        print(f"# best for {name}: PREFILL_TILES = {{{dim_pad}: {best[0]}}}  # {best[1]:.4f} ms", flush=True)
    return dict(
        heads=wargs.heads,
        kv_heads=wargs.kv_heads,
        head_dim=wargs.head_dim,
        torch_ms=rounded(torch_ms, 4),
        default_ms=rounded(rows[0][1], 4),
        default_tflops=rounded(tflops[None], 2),
        best_config=list(best[0]) if best[0] else None,
        best_ms=rounded(best[1], 4),
        best_tflops=rounded(tflops.get(best[0]), 2),
        best_frac_of_peak=rounded(tflops[best[0]] * 1e12 / peak, 4) if peak and best[0] else None,
        best_max_abs_diff=rounded(best[2], 4),
        configs_timed=len(timed),
        configs_skipped=len(rows) - 1 - len(timed),
        compile_s=rounded(compile_s, 1),
        sweep_s=rounded(time.perf_counter() - t0, 1),
    )


def time_config(fn, ref: torch.Tensor, args) -> tuple[float | None, float | str]:
    """(median ms, max |out - ref|) of one config, or (None, why) where it does not run (shared memory)."""
    try:
        err = (fn().float() - ref).abs().max().item()
        return time_ms(fn, args.iters, args.warmup), err
    except Exception as e:  # noqa: BLE001 (Triton's OutOfResources and launch failures: the config is skipped)
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"


def print_config(name: str, cfg, result, flops: int, peak: float | None, group: int) -> None:
    ms, err = result
    label = "default"
    if cfg is not None:
        rows, block_n, warps, stages = cfg
        label = f"rows={rows} (BLOCK_Q={max(1, rows // group)}) BLOCK_N={block_n} warps={warps} stages={stages}"
    if ms is None:
        print(f"# sweep {name} {label}: skipped ({err})", flush=True)
        return
    tflops = flops / ms / 1e9
    frac = f" {tflops * 1e12 / peak:.3f} of peak" if peak else ""
    print(f"# sweep {name} {label}: {ms:.4f} ms {tflops:.1f} TFLOP/s{frac} max_abs_diff {err:.4f}", flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    machine, commit = machine_description(), git_commit()
    if args.sweep:
        peak = args.peak_tflops * 1e12 if args.peak_tflops else roofline.dense_bf16_peak(machine.get("gpu", ""))
        for name in SWEEP_WORKLOADS:
            fig = sweep_workload(name, args, peak)
            emit(make_record(f"attention-sweep-{name}", machine, commit, **fig), append=not args.no_append)
        return
    limits = any(w.startswith("limit-") for w in args.workloads)
    copy_bw, peak = device_limits(args, machine) if limits else (None, None)
    for name in args.workloads:
        reqs, splits, heads = WORKLOADS[name]
        wargs = argparse.Namespace(**vars(args))
        if heads is not None:
            wargs.heads, wargs.kv_heads = heads
        fig = run_workload(name, shrunk(reqs, args.shrink), wargs, splits)
        fig |= limit_figures(name, fig, copy_bw, peak)
        if name.startswith("limit-"):
            fig |= {"copy_gb_s": rounded(copy_bw / 1e9, 1) if copy_bw else None}
            fig |= {"peak_tflops": rounded(peak / 1e12, 1) if peak else None}
        shapes = dict(heads=wargs.heads, kv_heads=wargs.kv_heads, head_dim=args.head_dim, block_size=args.block_size)
        extra = {"shrink": args.shrink} if args.shrink > 1 else {}
        emit(make_record(fig.pop("workload"), machine, commit, **fig, **shapes, **extra), append=not args.no_append)
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()  # the next workload's cache may be large (128k contexts)


if __name__ == "__main__":
    main()
