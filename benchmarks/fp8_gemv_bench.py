"""FP8 decode linears on the GPU at Llama-3.1-8B shapes: the skinny Triton kernel (with its activation quantization
launch, and alone on pre-quantized activations) against torch._scaled_mm plus the same quantization launch, and the
bf16 F.linear. Each op is captured 20 times into a CUDA graph (no launch overhead, and a check that the op is
capturable) cycling over enough weight copies to miss the L2 cache; printed: the median time per call over CUDA
events and GB/s = (weight + activation + output bytes) / time.

    PYTHONPATH=. python benchmarks/fp8_gemv_bench.py             # the table
    PYTHONPATH=. python benchmarks/fp8_gemv_bench.py --sweep     # also tiles, stages and split target at M=1 (minutes)
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
    dev = torch.device("cuda")
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    copies = max(1, -(-L2_MISS_BYTES // (n * k)))
    ws = torch.rand(n, device=dev) / 100 + 1e-3
    w8 = [(torch.randn(n, k, device=dev) * 50).to(torch.float8_e4m3fn) for _ in range(copies)]
    w16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(-(-copies // 2))]
    xq, xs = quantize_per_token_triton(x)
    io = m * k * 2 + m * n * 2

    def gemv(w):
        return lambda: fp8_gemv.fp8_gemv_linear(x, w, ws, None, None)

    def gemv_only(w):
        return lambda: fp8_gemv.fp8_gemv(xq, xs, w, ws, None, torch.bfloat16)

    def scaled_mm(w):
        def run():
            q, s = quantize_per_token_triton(x)
            return torch._scaled_mm(q, w.t(), scale_a=s, scale_b=ws.reshape(1, n), out_dtype=torch.bfloat16)

        return run

    return {
        "triton_gemv": ([gemv(w) for w in w8], n * k + io),
        "gemv_kernel_only": ([gemv_only(w) for w in w8], n * k + io),
        "scaled_mm+quant": ([scaled_mm(w) for w in w8], n * k + io),
        "bf16_linear": ([(lambda w=w: F.linear(x, w)) for w in w16], 2 * n * k + io),
    }


def table() -> dict:
    """Print one row per (N, K, M); return {(n, k, m): {op name: microseconds}}."""
    names = ["triton_gemv", "gemv_kernel_only", "scaled_mm+quant", "bf16_linear"]
    print(f"{'N':>6} {'K':>6} {'M':>3} " + " ".join(f"{name + ' us (GB/s)':>28}" for name in names) + "  speedup")
    results = {}
    for n, k in SHAPES:
        for m in BATCHES:
            ops = ops_for(m, n, k)
            us = results[n, k, m] = {name: time_us(ops[name][0]) for name in names}
            cells = " ".join(f"{us[name]:>16.1f} ({ops[name][1] / us[name] / 1e3:>7.0f})" for name in names)
            gemv_us = us["triton_gemv"]
            speed = f"x{us['scaled_mm+quant'] / gemv_us:.2f} vs mm, x{us['bf16_linear'] / gemv_us:.2f} vs bf16"
            print(f"{n:>6} {k:>6} {m:>3} {cells}  {speed}")
            del ops
            torch.cuda.empty_cache()
    return results


def layer_summary(results: dict) -> None:
    """The linears of one Llama-3.1-8B decoder layer (qkv, o, gate_up, down), summed per M."""
    layer = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
    print("one Llama-3.1-8B layer's linears (qkv + o + gate_up + down), us:")
    for m in BATCHES:
        total = {name: sum(results[n, k, m][name] for n, k in layer) for name in results[layer[0] + (m,)]}
        gemv_us = total["triton_gemv"]
        print(
            f"  M={m:>2}: triton_gemv {gemv_us:.1f}, scaled_mm+quant {total['scaled_mm+quant']:.1f}, "
            f"bf16 {total['bf16_linear']:.1f}  -> x{total['bf16_linear'] / gemv_us:.2f} vs bf16, "
            f"x{total['scaled_mm+quant'] / gemv_us:.2f} vs scaled_mm"
        )


def sweep() -> None:
    """M = 1, the kernel alone: GB/s per (BLOCK_N, BLOCK_K, pipeline stages, PROGRAMS_PER_SM)."""
    knobs = ("BLOCK_NS", "BLOCK_K", "NUM_STAGES", "PROGRAMS_PER_SM")
    saved = [getattr(fp8_gemv, name) for name in knobs]
    for n, k in SHAPES:
        fns, nbytes = ops_for(1, n, k)["gemv_kernel_only"]
        row = []
        for config in itertools.product((16, 32, 64, 128), (128, 256, 512), (3, 4, 6), (1, 2, 4)):
            for name, value in zip(knobs, ((config[0],),) + config[1:]):
                setattr(fp8_gemv, name, value)
            try:
                row.append((nbytes / time_us(fns) / 1e3, config))
            except Exception as e:  # a tile whose pipeline stages overflow shared memory
                print(f"  BN, BK, stages, P/SM = {config}: {type(e).__name__}")
        row.sort(reverse=True)
        best = ", ".join(f"{gbps:.0f} GB/s {config}" for gbps, config in row[:4])
        print(f"N={n} K={k} M=1 best (BN, BK, stages, P/SM): {best}")
        for name, value in zip(knobs, saved):
            setattr(fp8_gemv, name, value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="also sweep the kernel's tile sizes at M=1")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fp8_gemv_bench needs a CUDA GPU")
    print(torch.cuda.get_device_name(0))
    layer_summary(table())
    if args.sweep:
        sweep()


if __name__ == "__main__":
    main()
