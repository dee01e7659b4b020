"""W4A16 decode linears on the GPU at Llama-3.1-8B shapes: the CUDA-core GEMV (wna16_gemv.py) against the
tensor-core kernel of wna16_gemm.py and the bf16 F.linear, at M = 1, 2, 4, 8. The weights: 4-bit (--bits 8: 8-bit),
group 128 (--group), symmetric (--zero-points: a zero point per group; --codebook: nf4; --act-order: a permutation of
the input features, read by the GEMV inside, gathered before the tensor-core kernel). Each op is captured 20 times
into a CUDA graph (no launch overhead, and a check that the op is capturable) cycling over enough weight copies to
miss the L2 cache; printed: the median time per call over CUDA events and GB/s = (packed weight + scales +
activation + output bytes) / time, then one decoder layer's linears summed per M.

    PYTHONPATH=. python benchmarks/wna16_gemv_bench.py                 # the table
    PYTHONPATH=. python benchmarks/wna16_gemv_bench.py --sweep         # also the GEMV's configs per M (minutes)
    PYTHONPATH=. python benchmarks/wna16_gemv_bench.py --sweep --m 1   # the sweep at M = 1 only

The sweep times every (BLOCK_N, BLOCK_K, warps, programs per SM) of the grid below on the four linears of a layer
and prints the best per M as a CONFIGS entry for wna16_gemv.py, and the fused split-K reduction against the reduce
kernel for the best one.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
from fp8_gemv_bench import time_us  # (benchmarks/ is on the path of a script run from it)

from pagedllm.layers.quantization import wna16_gemv
from pagedllm.layers.quantization.bnb_format import codebook
from pagedllm.layers.quantization.wna16_gemm import wna16_gemm

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # (N, K): qkv, o, gate_up, down
BATCHES = [1, 2, 4, 8]
L2_MISS_BYTES = 256 << 20  # weight copies cycled per graph: at least this many bytes (H100 L2: 50 MB)
SWEEP_TILES = [(128, 1), (256, 1), (256, 2), (512, 2), (512, 4)]  # (BLOCK_N, warps): BLOCK_N >= 128 * warps
SWEEP_BLOCK_K = [16, 32, 64, 128, 256]
SWEEP_PROGRAMS = [1, 2, 4, 8]


def weights(n: int, k: int, args, copies: int = 0):
    """Copies of (qweight [K / pack, N], scales [K / group, N], zeros or None), by default enough to miss the L2
    cache; and the bytes one call reads of them. With --codebook the zeros slot holds nf4's table instead."""
    dev = torch.device("cuda")
    bits, group, zero_points = args.bits, args.group, args.zero_points
    nbytes = n * k * bits // 8
    copies = copies or max(1, -(-L2_MISS_BYTES // nbytes))
    groups = k // group
    out = []
    for _ in range(copies):
        words = torch.randint(-(1 << 31), 1 << 31, (k * bits // 32, n), device=dev, dtype=torch.int32)  # random values
        scales = torch.rand(groups, n, device=dev) / 50 + 1e-3
        zeros = torch.randint(0, 1 << bits, (groups, n), device=dev).float() if zero_points else None
        if args.codebook:
            zeros = codebook("nf4", dev)
        out.append((words, scales, zeros))
    return out, nbytes + scales.numel() * 4 * (2 if zero_points else 1)


def ops_for(m: int, n: int, k: int, args) -> dict:
    """name -> (list of callables over weight copies, bytes one call moves)."""
    dev = torch.device("cuda")
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    packed, wbytes = weights(n, k, args)
    w16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(max(1, -(-L2_MISS_BYTES // (2 * n * k))))]
    io = m * k * 2 + m * n * 2

    perm = torch.randperm(k, device=dev).int() if args.act_order else None

    def call(fn, w):
        if args.codebook:
            return lambda: fn(x, w[0], w[1], None, None, 4, args.group, w[2])
        return lambda: fn(x, w[0], w[1], w[2], None, args.bits, args.group)

    def call_perm(fn, w):  # act order: the GEMV reads x through perm, the tensor-core kernel after a gather
        if perm is None:
            return call(fn, w)
        if fn is wna16_gemm:
            return lambda: fn(x[:, perm], w[0], w[1], w[2], None, args.bits, args.group)
        return lambda: fn(x, w[0], w[1], w[2], None, args.bits, args.group, None, perm)

    return {
        "gemv": ([call_perm(wna16_gemv.wna16_gemv, w) for w in packed], wbytes + io),
        "tc_gemm": ([call_perm(wna16_gemm, w) for w in packed], wbytes + io),
        "bf16_linear": ([(lambda w=w: F.linear(x, w)) for w in w16], 2 * n * k + io),
    }


def check(args) -> None:
    """The GEMV against the tensor-core kernel at every shape and M (bf16 tolerance), before timing."""
    for (n, k), m in itertools.product(SHAPES, BATCHES):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        packed, _ = weights(n, k, args, copies=1)
        qw, s, z = packed[0]
        extra = (None, None, 4, args.group, z) if args.codebook else (z, None, args.bits, args.group)
        a = wna16_gemv.wna16_gemv(x, qw, s, *extra).float()
        b = wna16_gemm(x, qw, s, *extra).float()
        err = ((a - b).abs().max() / b.abs().max()).item()
        if err > 2e-2:
            raise SystemExit(f"N={n} K={k} M={m}: GEMV and tensor-core kernel differ by {err:.3g} (relative)")


def table(args) -> dict:
    """Print one row per (N, K, M); return {(n, k, m): {op name: microseconds}}."""
    names = ["gemv", "tc_gemm", "bf16_linear"]
    print(f"{'N':>6} {'K':>6} {'M':>3} " + " ".join(f"{name + ' us (GB/s)':>26}" for name in names) + "  speedup")
    results = {}
    for n, k in SHAPES:
        for m in BATCHES:
            ops = ops_for(m, n, k, args)
            us = results[n, k, m] = {name: time_us(ops[name][0]) for name in names}
            cells = " ".join(f"{us[name]:>14.1f} ({ops[name][1] / us[name] / 1e3:>7.0f})" for name in names)
            g = us["gemv"]
            print(f"{n:>6} {k:>6} {m:>3} {cells}  x{us['tc_gemm'] / g:.2f} vs tc, x{us['bf16_linear'] / g:.2f} vs bf16")
            del ops
            torch.cuda.empty_cache()
    return results


def layer_summary(results: dict) -> None:
    print("one Llama-3.1-8B layer's linears (qkv + o + gate_up + down), us:")
    for m in BATCHES:
        total = {name: sum(results[n, k, m][name] for n, k in SHAPES) for name in results[SHAPES[0] + (m,)]}
        g = total["gemv"]
        print(
            f"  M={m}: gemv {g:.1f}, tc_gemm {total['tc_gemm']:.1f}, bf16 {total['bf16_linear']:.1f}"
            f"  -> x{total['bf16_linear'] / g:.2f} vs bf16, x{total['tc_gemm'] / g:.2f} vs tc_gemm"
        )


def sweep(args) -> None:
    """Per M: the layer's four GEMVs summed for every config of the grid; the best as a CONFIGS entry."""
    saved, saved_fused = dict(wna16_gemv.CONFIGS), wna16_gemv.FUSED_REDUCE
    for m in args.m:
        block_m = 1 if m == 1 else (2 if m == 2 else (4 if m <= 4 else 8))
        fns = {shape: ops_for(m, *shape, args)["gemv"][0] for shape in SHAPES}
        rows = []
        for (block_n, warps), block_k, programs in itertools.product(SWEEP_TILES, SWEEP_BLOCK_K, SWEEP_PROGRAMS):
            config = (block_n, block_k, warps, programs)
            if block_m >= 4 and block_k > 64:
                continue  # several rows' accumulators and long steps: out of registers
            wna16_gemv.CONFIGS[block_m] = config
            try:
                rows.append((sum(time_us(f) for f in fns.values()), config))
            except Exception as e:  # out of registers or shared memory
                print(f"  M={m} {config}: {type(e).__name__}")
        rows.sort()
        best = rows[0][1]
        print(f"M={m} layer us, best (BLOCK_N, BLOCK_K, warps, programs/SM): " + ", ".join(
            f"{us:.1f} {config}" for us, config in rows[:5]
        ))  # fmt: skip
        wna16_gemv.CONFIGS[block_m] = best
        wna16_gemv.FUSED_REDUCE = False
        unfused = sum(time_us(f) for f in fns.values())
        wna16_gemv.FUSED_REDUCE = saved_fused
        print(f"  best with the reduce kernel instead of the fused reduction: {unfused:.1f} us")
        print(f"  CONFIGS[{block_m}] = {best}")
        wna16_gemv.CONFIGS.clear()
        wna16_gemv.CONFIGS.update(saved)
        del fns
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bits", type=int, default=4, choices=(4, 8))
    parser.add_argument("--group", type=int, default=128, help="input features per scale (divides 4096 and 14336)")
    parser.add_argument("--zero-points", action="store_true", help="asymmetric: a zero point per group")
    parser.add_argument("--codebook", action="store_true", help="bitsandbytes nf4: a 16-value table, 4 bits")
    parser.add_argument("--act-order", action="store_true", help="a random input-feature permutation (desc_act)")
    parser.add_argument("--sweep", action="store_true", help="also sweep the GEMV's configs")
    parser.add_argument("--m", type=int, nargs="+", default=BATCHES, help="batch sizes the sweep covers")
    args = parser.parse_args()
    if args.codebook:
        args.bits, args.zero_points, args.act_order = 4, False, False
    if not torch.cuda.is_available():
        raise SystemExit("wna16_gemv_bench needs a CUDA GPU")
    print(torch.cuda.get_device_name(0), f"bits={args.bits} group={args.group} zero_points={args.zero_points}", end=" ")
    print(f"codebook={args.codebook} act_order={args.act_order}")
    check(args)
    layer_summary(table(args))
    if args.sweep:
        sweep(args)


if __name__ == "__main__":
    main()
