"""FP8 decode linears on the GPU at Llama-3.1-8B shapes, in one run: the skinny Triton kernel quantizing its activations
itself (fused; fused_1launch: its split K summed in the kernel, not by a second launch; fused_1launch_tma: also its
weight tiles read by the TMA unit), the same kernel after the separate per-token quantization launch (unfused), the
kernel alone on pre-quantized activations, torch._scaled_mm plus the quantization launch, and the bf16 F.linear. Each
op is captured 20 times into a CUDA graph (no launch overhead, and a check that the op is capturable) cycling over
enough weight copies to miss the L2 cache; printed: the median time per call over CUDA events and GB/s = (weight +
activation + output bytes) / time.

    PYTHONPATH=. python benchmarks/fp8_gemv_bench.py             # the table
    PYTHONPATH=. python benchmarks/fp8_gemv_bench.py --sweep     # also the fused kernel's knobs at M=1 (minutes)
    PYTHONPATH=. python benchmarks/fp8_gemv_bench.py --sweep --sweep-m 1 16 --shapes 4096x4096 28672x4096 \
        --grid NUM_WARPS=4,8 --grid SPLIT_IN_KERNEL=0,1
    PYTHONPATH=. python benchmarks/fp8_gemv_bench.py --set BLOCK_NS=128 --set SPLIT_IN_KERNEL=1  # other knobs
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch
import torch.nn.functional as F

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
    graph.replay()
    times = []
    for _ in range(10):
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
    }


NAMES = ["fused", "fused_1launch", "fused_1launch_tma", "unfused", "gemv_kernel_only", "scaled_mm+quant", "bf16_linear"]


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
# the values swept, in KNOBS order (--grid NAME=V1,V2 replaces one)
GRID = [(32, 64, 128), (128, 256), (3, 4, 6), (1, 2), (4,), (1,), (0, 1)]


def set_knob(name: str, value) -> None:
    setattr(fp8_gemv, name, (value,) if name == "BLOCK_NS" else value)


def parse_grid(text: str) -> tuple[str, tuple[int, ...]]:
    name, _, values = text.partition("=")
    if name not in KNOBS or not all(v.isdigit() for v in values.split(",")):
        raise argparse.ArgumentTypeError(f"--grid {text!r}: NAME=INT,INT,... with NAME one of {KNOBS}")
    return name, tuple(int(v) for v in values.split(","))


def sweep(shapes, batches) -> None:
    """The fused kernel per (shape, M): GB/s for each knob setting of GRID, the best four printed."""
    saved = {name: getattr(fp8_gemv, name) for name in KNOBS}
    for (n, k), m in itertools.product(shapes, batches):
        fns, nbytes = ops_for(m, n, k)["fused"]
        row = []
        for config in itertools.product(*GRID):
            for name, value in zip(KNOBS, config):
                set_knob(name, value)
            try:
                row.append((nbytes / time_us(fns) / 1e3, config))
            except Exception as e:  # a tile whose pipeline stages overflow shared memory
                print(f"  {dict(zip(KNOBS, config))}: {type(e).__name__}")
        row.sort(reverse=True)
        best = ", ".join(f"{gbps:.0f} GB/s {config}" for gbps, config in row[:4])
        print(f"N={n} K={k} M={m} best {KNOBS}: {best}")
        for name, value in saved.items():
            setattr(fp8_gemv, name, value)


def parse_set(text: str) -> tuple[str, int]:
    name, _, value = text.partition("=")
    if name not in KNOBS + MORE_KNOBS or not value.isdigit():
        raise argparse.ArgumentTypeError(f"--set {text!r}: NAME=INT with NAME one of {KNOBS + MORE_KNOBS}")
    return name, int(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="also sweep the fused kernel's knobs (GRID)")
    parser.add_argument("--sweep-m", type=int, nargs="+", default=[1], help="batch sizes the sweep times")
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
        GRID[KNOBS.index(name)] = values
    print(torch.cuda.get_device_name(0), {name: getattr(fp8_gemv, name) for name in KNOBS + MORE_KNOBS})
    layer_summary(table(shapes, args.batches), args.batches)
    if args.sweep:
        sweep(shapes, args.sweep_m)


if __name__ == "__main__":
    main()
