"""FP8 decode linears on the GPU at Llama-3.1-8B shapes, in one run: the skinny Triton kernel quantizing its activations
itself (fused; fused_1launch: its split K summed in the kernel, not by a second launch; fused_1launch_tma: also its
weight tiles read by the TMA unit), the same kernel after the separate per-token quantization launch (unfused), the
kernel alone on pre-quantized activations, torch._scaled_mm plus the quantization launch, the bf16 F.linear and the
kernel on bf16 weights (dense_gemv: what bf16 decode runs at one row). Each op is captured 20 times into a CUDA graph
(no launch overhead, and a check that the op is capturable) cycling over enough weight copies to miss the L2 cache;
printed: the median time per call over CUDA events and GB/s = (weight + activation + output bytes) / time.

    PYTHONPATH=. python benchmarks/fp8_gemv_bench.py             # the table
    PYTHONPATH=. python benchmarks/fp8_gemv_bench.py --sweep     # the per-shape tile sweep at M=1 instead
    PYTHONPATH=. python benchmarks/fp8_gemv_bench.py --sweep --sweep-m 1 16 --shapes 4096x4096 28672x4096 \
        --grid WARPS=4,8 --grid IN_KERNEL=1
    PYTHONPATH=. python benchmarks/fp8_gemv_bench.py --set BLOCK_NS=128 --set SPLIT_IN_KERNEL=1  # other knobs

The sweep times fp8_gemv_linear (quantizing inside the kernel at one row) per (N, K) and M for every GRID entry of
fp8_gemv.TABLE's fields, each checked against float32 math on the same fp8 operands first (kernels compiled first in
--jobs processes), and prints each shape's best entry, its GB/s and fraction of the device-to-device copy bandwidth
measured in the same run, the default settings' time, and the winners as a TABLE literal for fp8_gemv.py.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import multiprocessing
import os
import statistics
import time

import torch
import torch.nn.functional as F
from gpu_throughput import copy_bandwidth  # (benchmarks/: the path of a script run there)

from pagedllm.layers.quantization import fp8_gemv
from pagedllm.layers.quantization.fp8_ops import quantize_per_token_triton

SHAPES = [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (1024, 4096)]  # (N, K)
BATCHES = [1, 2, 4, 8, 16]
CALLS = 20  # calls per graph
DEVICE = "cuda"
L2_MISS_BYTES = 256 << 20  # weight copies cycled per graph: at least this many bytes (H100 L2: 50 MB)


def time_us(fns) -> float:
    """Median microseconds per call of the callables (cycled, CALLS per graph replay)."""
    for fn in fns[:2]:
        fn()  # compile / autotune outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            fns[i % len(fns)]()
    return replay_us(graph, 10)


def sweep_us(fns, replays: int = 5) -> float:
    """time_us for sweeps of thousands of configs: the graph captured with the plain capture calls on a side stream
    (torch.cuda.graph collects garbage at every capture, which would dominate), fewer replays."""
    for fn in fns[:2]:
        fn()  # compile (or load from the disk cache) outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin()
        for i in range(CALLS):
            fns[i % len(fns)]()
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return replay_us(graph, replays)


def replay_us(graph, replays: int) -> float:
    """Median microseconds per call over `replays` timed replays of a graph of CALLS calls (one untimed first)."""
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / CALLS)
    return statistics.median(times)


def ops_for(m: int, n: int, k: int) -> dict:
    """name -> (list of callables over weight copies, bytes one call moves)."""
    dev = torch.device(DEVICE)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    copies = max(1, -(-L2_MISS_BYTES // (n * k)))
    ws = torch.rand(n, device=dev) / 100 + 1e-3
    w8 = [(torch.randn(n, k, device=dev) * 50).to(torch.float8_e4m3fn) for _ in range(copies)]
    w16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(-(-copies // 2))]
    xq, xs = quantize_per_token_triton(x)
    io = m * k * 2 + m * n * 2

    def fused(w, **knobs):  # knobs: fp8_gemv module settings for this op only
        def run():
            saved = {name: getattr(fp8_gemv, name) for name in knobs}
            for name, value in knobs.items():
                setattr(fp8_gemv, name, value)
            try:
                return fp8_gemv.fp8_gemv_fused(x, w, ws, None, None)
            finally:
                for name, value in saved.items():
                    setattr(fp8_gemv, name, value)

        return run

    def unfused(w):
        def run():
            q, s = quantize_per_token_triton(x)
            return fp8_gemv.fp8_gemv(q, s, w, ws, None, torch.bfloat16)

        return run

    def gemv_only(w):
        return lambda: fp8_gemv.fp8_gemv(xq, xs, w, ws, None, torch.bfloat16)

    def scaled_mm(w):
        def run():
            q, s = quantize_per_token_triton(x)
            return torch._scaled_mm(q, w.t(), scale_a=s, scale_b=ws.reshape(1, n), out_dtype=torch.bfloat16)

        return run

    return {
        "fused": ([fused(w) for w in w8], n * k + io),
        "fused_1launch": ([fused(w, SPLIT_IN_KERNEL=True) for w in w8], n * k + io),
        "fused_1launch_tma": ([fused(w, SPLIT_IN_KERNEL=True, W_TMA=True) for w in w8], n * k + io),
        "unfused": ([unfused(w) for w in w8], n * k + io),
        "gemv_kernel_only": ([gemv_only(w) for w in w8], n * k + io),
        "scaled_mm+quant": ([scaled_mm(w) for w in w8], n * k + io),
        "bf16_linear": ([(lambda w=w: F.linear(x, w)) for w in w16], 2 * n * k + io),
        "bf16_dense_gemv": ([(lambda w=w: fp8_gemv.dense_gemv(x, w, None)) for w in w16], 2 * n * k + io),
    }


NAMES = [
    "fused", "fused_1launch", "fused_1launch_tma", "unfused", "gemv_kernel_only", "scaled_mm+quant", "bf16_linear",
    "bf16_dense_gemv",
]  # fmt: skip


def table(shapes, batches) -> dict:
    """Print one row per (N, K, M), after checking that fused and unfused agree bit for bit; return
    {(n, k, m): {op name: microseconds}}."""
    print(f"{'N':>6} {'K':>6} {'M':>3} " + " ".join(f"{name + ' us (GB/s)':>27}" for name in NAMES) + "  fused:")
    results = {}
    for n, k in shapes:
        for m in batches:
            ops = ops_for(m, n, k)
            want = ops["unfused"][0][0]()
            for name in ("fused", "fused_1launch", "fused_1launch_tma"):
                if not torch.equal(ops[name][0][0](), want):
                    raise SystemExit(f"N={n} K={k} M={m}: {name}'s result differs from quantizing first")
            us = results[n, k, m] = {name: time_us(ops[name][0]) for name in NAMES}
            cells = " ".join(f"{us[name]:>15.1f} ({ops[name][1] / us[name] / 1e3:>7.0f})" for name in NAMES)
            f = us["fused"]
            speed = f"x{us['unfused'] / f:.2f} vs unfused, x{us['scaled_mm+quant'] / f:.2f} vs mm, "
            print(f"{n:>6} {k:>6} {m:>3} {cells}  {speed}x{us['bf16_linear'] / f:.2f} vs bf16")
            del ops
            torch.cuda.empty_cache()
    return results


def layer_summary(results: dict, batches) -> None:
    """The linears of one Llama-3.1-8B decoder layer (qkv, o, gate_up, down), summed per M."""
    layer = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
    if any((n, k, batches[0]) not in results for n, k in layer):
        return
    print("one Llama-3.1-8B layer's linears (qkv + o + gate_up + down), us (speedup vs bf16):")
    for m in batches:
        total = {name: sum(results[n, k, m][name] for n, k in layer) for name in NAMES}
        bf16 = total["bf16_linear"]
        cells = ", ".join(f"{name} {total[name]:.1f} (x{bf16 / total[name]:.2f})" for name in NAMES)
        print(f"  M={m:>2}: {cells}")


KNOBS = ("BLOCK_NS", "BLOCK_K", "NUM_STAGES", "PROGRAMS_PER_SM", "NUM_WARPS", "SPLIT_IN_KERNEL", "W_TMA")
MORE_KNOBS = ("AMAX_ROW", "AMAX_COLS", "AMAX_STAGES", "FUSE_MAX_M")  # for --set only
# the sweep's values of each TABLE field but the K splits (--grid NAME=V1,V2 replaces one); splits: none and those
# for SWEEP_PROGRAMS programs per SM
GRID = {"BLOCK_N": (32, 64, 128), "BLOCK_K": (128, 256), "WARPS": (4,), "STAGES": (3, 4, 6), "IN_KERNEL": (0, 1)}
GRID["TMA"] = (0, 1)
SWEEP_PROGRAMS = (1, 2, 4)
SMEM_BYTES = 160 << 10  # tiles whose fp8 weight stages need more shared memory than this are skipped


def set_knob(name: str, value) -> None:
    setattr(fp8_gemv, name, (value,) if name == "BLOCK_NS" else value)


def parse_grid(text: str) -> tuple[str, tuple[int, ...]]:
    name, _, values = text.partition("=")
    if name not in GRID or not all(v.isdigit() for v in values.split(",")):
        raise argparse.ArgumentTypeError(f"--grid {text!r}: NAME=INT,INT,... with NAME one of {tuple(GRID)}")
    return name, tuple(int(v) for v in values.split(","))


def grid_entries(n: int, k: int) -> list[tuple[int, ...]]:
    """TABLE entries (BLOCK_N, BLOCK_K, warps, stages, splits, in kernel, TMA) the sweep times for an [N, K] weight."""
    sms = fp8_gemv.sm_count(torch.device(DEVICE))
    entries = []
    for block_n, block_k, warps, stages, in_kernel, tma in itertools.product(*GRID.values()):
        if block_n * block_k * stages > SMEM_BYTES:
            continue
        chunks, grid_n = -(-k // block_k), -(-n // block_n)
        splits = {-(-chunks // -(-chunks // max(1, -(-p * sms // grid_n)))) for p in SWEEP_PROGRAMS} | {1}
        for split in sorted(splits):
            if split > 1 or in_kernel == 0:  # (one split: nothing to sum)
                entries.append((block_n, block_k, warps, stages, split, in_kernel, tma))
    return entries


def compile_entries(args_list) -> None:
    """Worker: one launch of each (M, entry) on a 4096 x 4096 weight, compiling into Triton's disk cache."""
    n = k = 4096
    w = (torch.randn(n, k, device=DEVICE) * 50).to(torch.float8_e4m3fn)
    ws = torch.rand(n, device=DEVICE) / 100 + 1e-3
    for m, entry in args_list:
        x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
        fp8_gemv.TABLE[(1 if m == 1 else 16, n, k)] = (*entry[:4], 1 if entry[4] == 1 else 2, *entry[5:])
        try:
            fp8_gemv.fp8_gemv_linear(x, w, ws, None, None)
        except Exception as e:  # reported again by the sweep
            print(f"  compile M={m} {entry}: {type(e).__name__}", flush=True)
    torch.cuda.synchronize()


def precompile(batches, jobs: int) -> None:
    """The sweep's kernels compiled in `jobs` processes first (N and K only bound masks: one shape compiles all)."""
    tasks = sorted({(m, (*e[:4], min(e[4], 2), *e[5:])) for m in batches for e in grid_entries(4096, 14336)})
    if jobs <= 1:
        return
    context = multiprocessing.get_context("spawn")
    try:
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
            list(pool.map(compile_entries, [tasks[i::jobs] for i in range(jobs)]))
    except Exception as e:  # the sweep compiles what is missing itself
        print(f"  precompile: {type(e).__name__}: {e}", flush=True)


def sweep_case(n: int, k: int, m: int) -> tuple[float, list, int]:
    """(the default settings' microseconds, [(us, entry)] of every correct entry fastest first, bytes a call moves):
    fp8_gemv_linear (quantizing in the kernel at one row, first above), each entry checked against float32 math on
    the same fp8 operands first."""
    nbytes = n * k + m * k * 2 + m * n * 2
    dev = torch.device(DEVICE)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    copies = max(1, -(-L2_MISS_BYTES // (n * k)))
    ws = torch.rand(n, device=dev) / 100 + 1e-3
    w8 = [(torch.randn(n, k, device=dev) * 50).to(torch.float8_e4m3fn) for _ in range(copies)]
    xq, xs = quantize_per_token_triton(x)
    ref = (xq.float() @ w8[0].float().T) * xs * ws
    fns = [lambda w=w: fp8_gemv.fp8_gemv_linear(x, w, ws, None, None) for w in w8]
    key = (1 if m == 1 else 16, n, k)
    fp8_gemv.TABLE.pop(key, None)
    default_us = sweep_us(fns)
    rows = []
    for entry in grid_entries(n, k):
        fp8_gemv.TABLE[key] = entry
        try:
            err = ((fns[0]().float() - ref).abs().max() / ref.abs().max()).item()
            if err > 1e-2:
                print(f"  WRONG N={n} K={k} M={m} {entry}: relative error {err:.3g}")
                continue
            rows.append((sweep_us(fns), entry))
        except Exception as e:  # out of shared memory or registers
            print(f"  N={n} K={k} M={m} {entry}: {type(e).__name__}: {str(e)[:200]}")
    del fp8_gemv.TABLE[key]
    return default_us, sorted(rows), nbytes


def sweep(shapes, batches, jobs: int) -> None:
    """Per (shape, M): the best TABLE entry, its GB/s and fraction of the copy bandwidth, the default's time; the
    shapes' sums; the TABLE literal for fp8_gemv.py."""
    began = time.perf_counter()
    copy_gbs = copy_bandwidth(1 << 30) / 1e9  # a 1 GiB device-to-device copy, bytes read + written
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write)")
    precompile(batches, jobs)
    table, totals = {}, {}
    for (n, k), m in itertools.product(shapes, batches):
        default_us, rows, nbytes = sweep_case(n, k, m)
        if not rows:
            print(f"N={n} K={k} M={m}: no entry ran correctly", flush=True)
            continue
        best_us, best = rows[0]
        table[(1 if m == 1 else 16, n, k)] = best
        totals[m] = [a + b for a, b in zip(totals.get(m, [0.0, 0.0]), (best_us, default_us))]
        gbs = nbytes / best_us / 1e3
        print(
            f"N={n} K={k} M={m}: best {best} {best_us:.1f} us, {gbs:.0f} GB/s = {gbs / copy_gbs:.2f} of copy; "
            f"default {default_us:.1f} us; next: " + ", ".join(f"{us:.1f} {entry}" for us, entry in rows[1:4]),
            flush=True,
        )
        torch.cuda.empty_cache()
    for m, (best, default) in totals.items():
        print(f"the shapes' sum at M={m}: best {best:.1f} us, default {default:.1f} us")
    print(
        f"# (1 | 16 rows, N, K) -> (BLOCK_N, BLOCK_K, warps, stages, splits, in kernel, TMA); copy {copy_gbs:.0f} GB/s"
    )
    print("TABLE = {\n" + "".join(f"    {key}: {entry},\n" for key, entry in table.items()) + "}")
    print(f"the sweep took {time.perf_counter() - began:.0f} s")


def parse_set(text: str) -> tuple[str, int]:
    name, _, value = text.partition("=")
    if name not in KNOBS + MORE_KNOBS or not value.isdigit():
        raise argparse.ArgumentTypeError(f"--set {text!r}: NAME=INT with NAME one of {KNOBS + MORE_KNOBS}")
    return name, int(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="the per-shape tile sweep (GRID) instead of the table")
    parser.add_argument("--sweep-m", type=int, nargs="+", default=[1], help="batch sizes the sweep times")
    parser.add_argument("--jobs", type=int, default=min(14, os.cpu_count() or 1), help="the sweep's compile processes")
    parser.add_argument("--shapes", nargs="+", default=[f"{n}x{k}" for n, k in SHAPES], help="NxK weights")
    parser.add_argument("--batches", type=int, nargs="+", default=BATCHES, help="batch sizes of the table")
    parser.add_argument("--set", type=parse_set, action="append", default=[], help="a knob for the whole run")
    parser.add_argument("--grid", type=parse_grid, action="append", default=[], help="a knob's values to sweep")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fp8_gemv_bench needs a CUDA GPU")
    shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes]
    for name, value in args.set:
        set_knob(name, value)
    for name, values in args.grid:
        GRID[name] = values
    print(torch.cuda.get_device_name(0), {name: getattr(fp8_gemv, name) for name in KNOBS + MORE_KNOBS})
    if args.sweep:
        sweep(shapes, args.sweep_m, args.jobs)
        return
    layer_summary(table(shapes, args.batches), args.batches)


if __name__ == "__main__":
    main()
