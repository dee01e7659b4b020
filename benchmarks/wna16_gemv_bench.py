"""W4A16 decode linears on the GPU at Llama-3.1-8B shapes: the CUDA-core GEMV (wna16_gemv.py) against the
tensor-core kernel of wna16_gemm.py and the bf16 F.linear, at M = 1, 2, 4, 8. The weights: 4-bit (--bits 8: 8-bit),
group 128 (--group), symmetric (--zero-points: a zero point per group; --codebook: nf4; --act-order: a permutation of
the input features, read by the GEMV inside, gathered before the tensor-core kernel). Each op is captured 20 times
into a CUDA graph (no launch overhead, and a check that the op is capturable) cycling over enough weight copies to
miss the L2 cache; printed: the median time per call over CUDA events and GB/s = (packed weight + scales +
activation + output bytes) / time, then one decoder layer's linears summed per M. At M = 1 the column gemv_f32 times
the GEMV with wna16_gemv.PAIRS off (the float32 step instead of the bf16x2 one of wna16_pairs.py).

    PYTHONPATH=. python benchmarks/wna16_gemv_bench.py                 # the table
    PYTHONPATH=. python benchmarks/wna16_gemv_bench.py --sweep         # the tile sweep instead (about 2 minutes)
    PYTHONPATH=. python benchmarks/wna16_gemv_bench.py --sweep --sweep-m 1 --shapes 4096x4096

The sweep times, for every (N, K) of the layer and M = 1, 2, 4 (and act order at M = 1), every tile of
wna16_gemv.sweep_tiles (BLOCK_N, BLOCK_K, warps, pipeline stages) with a few K splits each, after checking each one
against the dequantized weight; it prints each shape's best tile, its GB/s and its fraction of the device-to-device
copy bandwidth measured in the same run, the default tiles' time, one layer's sum per M against bf16, and the
winners as a TABLE literal for wna16_gemv.py. Its kernels compile first in --jobs processes (Triton's disk cache).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import multiprocessing
import os
import time

import torch
import torch.nn.functional as F
from fp8_gemv_bench import sweep_us, time_us  # (benchmarks/: the path of a script run there)
from gpu_throughput import copy_bandwidth

from pagedllm.layers.quantization import wna16_gemv
from pagedllm.layers.quantization.bnb_format import codebook
from pagedllm.layers.quantization.wna16_gemm import wna16_dequantize, wna16_gemm

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # (N, K): qkv, o, gate_up, down
BATCHES = [1, 2, 4, 8]
L2_MISS_BYTES = 256 << 20  # weight copies cycled per graph: at least this many bytes (H100 L2: 50 MB)
DEVICE = "cuda"
SWEEP_PROGRAMS = (1, 2, 4, 8)  # programs per SM the sweep's K splits aim at (and no split)


def weights(n: int, k: int, args, copies: int = 0):
    """Copies of (qweight [K / pack, N], scales [K / group, N], zeros or None), by default enough to miss the L2
    cache; and the bytes one call reads of them. With --codebook the zeros slot holds nf4's table instead."""
    dev = torch.device(DEVICE)
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


def float32_step(fn):
    """fn run with wna16_gemv.PAIRS off (a CUDA graph captured over it keeps the float32 step)."""

    def run():
        saved, wna16_gemv.PAIRS = wna16_gemv.PAIRS, False
        try:
            return fn()
        finally:
            wna16_gemv.PAIRS = saved

    return run


def ops_for(m: int, n: int, k: int, args) -> dict:
    """name -> (list of callables over weight copies, bytes one call moves)."""
    dev = torch.device(DEVICE)
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

    ops = {
        "gemv": ([call_perm(wna16_gemv.wna16_gemv, w) for w in packed], wbytes + io),
        "tc_gemm": ([call_perm(wna16_gemm, w) for w in packed], wbytes + io),
        "bf16_linear": ([(lambda w=w: F.linear(x, w)) for w in w16], 2 * n * k + io),
    }
    if m == 1:  # the float32 step next to the default (the bf16x2 one where it applies)
        ops["gemv_f32"] = ([float32_step(fn) for fn in ops["gemv"][0]], wbytes + io)
    return ops


def check(args) -> None:
    """The GEMV against the tensor-core kernel at every shape and M (bf16 tolerance), before timing."""
    for (n, k), m in itertools.product(SHAPES, BATCHES):
        x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
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
    names = ["gemv", "gemv_f32", "tc_gemm", "bf16_linear"]
    print(f"{'N':>6} {'K':>6} {'M':>3} " + " ".join(f"{name + ' us (GB/s)':>26}" for name in names) + "  speedup")
    results = {}
    for n, k in SHAPES:
        for m in BATCHES:
            ops = ops_for(m, n, k, args)
            us = results[n, k, m] = {name: time_us(ops[name][0]) for name in names if name in ops}
            cells = " ".join(
                f"{us[name]:>14.1f} ({ops[name][1] / us[name] / 1e3:>7.0f})" if name in us else f"{'-':>26}"
                for name in names
            )
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
            + (f"; gemv_f32 {total['gemv_f32']:.1f} (x{total['gemv_f32'] / g:.2f})" if "gemv_f32" in total else "")
        )


def split_choices(n: int, k: int, tile, args) -> list[int]:
    """The K splits a tile is timed with: none, and the counts for each of SWEEP_PROGRAMS programs per SM."""
    block_n, block_k = tile[0], tile[1] * 4 // args.bits
    sms = wna16_gemv.sm_count(torch.device(DEVICE))
    grid_n = -(-n // block_n)
    wants = (1, *(-(-p * sms // grid_n) for p in SWEEP_PROGRAMS))
    return sorted({wna16_gemv.split_k(k, block_k, want)[0] for want in wants})


def gemv_call(x, w, perm, args):
    return wna16_gemv.wna16_gemv(x, w[0], w[1], w[2], None, args.bits, args.group, None, perm)


def compile_tiles(tasks, args) -> None:
    """Worker: one launch of each (M, act order, tile, splits) on a 4096 x 4096 weight, compiling into the disk cache
    (the sweep's shapes share these kernels: N and K only bound masks)."""
    n = k = 4096
    w = weights(n, k, args, copies=1)[0][0]
    for m, act_order, tile, want in tasks:
        x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
        perm = torch.randperm(k, device=DEVICE).int() if act_order else None
        wna16_gemv.TABLE[(args.bits, wna16_gemv.block_m_for(m), n, k, act_order)] = (*tile[:3], want, tile[3])
        try:
            gemv_call(x, w, perm, args)
        except Exception as e:  # reported again by the sweep itself
            print(f"  compile M={m} {tile}: {type(e).__name__}", flush=True)
    torch.cuda.synchronize()


def precompile(cases, args) -> None:
    """Every kernel the sweep will launch, compiled in --jobs processes first (about 1-2 s each, one core each)."""
    tasks = []
    for m, act_order in cases:
        tiles = wna16_gemv.sweep_tiles(wna16_gemv.block_m_for(m))
        tasks += [(m, act_order, tile, want) for tile in tiles for want in (1, 2)]  # one split, several
    if args.jobs <= 1:
        return
    chunks = [tasks[i :: args.jobs] for i in range(args.jobs)]
    context = multiprocessing.get_context("spawn")
    try:
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
            list(pool.map(compile_tiles, chunks, [args] * len(chunks)))
    except Exception as e:  # the sweep compiles what is missing itself
        print(f"  precompile: {type(e).__name__}: {e}", flush=True)


def sweep_case(n: int, k: int, m: int, act_order: bool, packed, args) -> tuple[float, list]:
    """(the default tiles' microseconds, [(us, TABLE entry)] of every correct tile and split, fastest first)."""
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    perm = torch.randperm(k, device=DEVICE).int() if act_order else None
    w0 = packed[0]
    dense = wna16_dequantize(w0[0], w0[1], w0[2], k, args.bits, args.group, torch.float32)  # [K, N]
    ref = (x[:, perm] if act_order else x).float() @ dense
    fns = [lambda w=w: gemv_call(x, w, perm, args) for w in packed]
    key = (args.bits, wna16_gemv.block_m_for(m), n, k, act_order)
    wna16_gemv.TABLE.pop(key, None)
    default_us = sweep_us(fns)
    rows = []
    for tile in wna16_gemv.sweep_tiles(key[1]):
        for want in split_choices(n, k, tile, args):
            entry = wna16_gemv.TABLE[key] = (*tile[:3], want, tile[3])
            try:
                err = ((gemv_call(x, w0, perm, args).float() - ref).abs().max() / ref.abs().max()).item()
                if err > 2e-2:
                    print(f"  WRONG N={n} K={k} M={m} act_order={act_order} {entry}: relative error {err:.3g}")
                    continue
                rows.append((sweep_us(fns), entry))
            except Exception as e:  # out of registers or shared memory
                print(f"  N={n} K={k} M={m} {entry}: {type(e).__name__}: {str(e)[:200]}")
    del wna16_gemv.TABLE[key]
    return default_us, sorted(rows)


def sweep(args) -> None:
    """Every shape and batch of the sweep: the best tile, its GB/s and fraction of copy bandwidth; the layer's sums;
    the TABLE literal."""
    began = time.perf_counter()
    copy_gbs = copy_bandwidth(1 << 30) / 1e9  # a 1 GiB device-to-device copy, bytes read + written
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write)")
    cases = [(m, False) for m in args.sweep_m] + ([(1, True)] if 1 in args.sweep_m and not args.no_act_order else [])
    precompile(cases, args)
    table, totals = {}, {}
    for n, k in args.shapes:
        packed, wbytes = weights(n, k, args)
        w16 = [torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) for _ in range(-(-L2_MISS_BYTES // (2 * n * k)))]
        for m, act_order in cases:
            default_us, rows = sweep_case(n, k, m, act_order, packed, args)
            if not rows:
                print(f"N={n} K={k} M={m} act_order={act_order}: no tile ran correctly", flush=True)
                continue
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            bf16_us = sweep_us([lambda w=w, x=x: F.linear(x, w) for w in w16])
            best_us, best = rows[0]
            table[(args.bits, wna16_gemv.block_m_for(m), n, k, act_order)] = best
            gbs = (wbytes + m * k * 2 + m * n * 2) / best_us / 1e3
            for name, us in (("default", default_us), ("best", best_us), ("bf16", bf16_us)):
                totals[m, act_order, name] = totals.get((m, act_order, name), 0.0) + us
            print(
                f"N={n} K={k} M={m} act_order={act_order}: best {best} {best_us:.1f} us, {gbs:.0f} GB/s = "
                f"{gbs / copy_gbs:.2f} of copy; default {default_us:.1f} us; bf16 {bf16_us:.1f} us; next: "
                + ", ".join(f"{us:.1f} {entry}" for us, entry in rows[1:4]),
                flush=True,
            )
        del packed, w16
        torch.cuda.empty_cache()
    print("the shapes' sums (one Llama-3.1-8B layer's linears with the default shapes), us:")
    for m, act_order in cases:
        if (m, act_order, "best") not in totals:
            continue
        best, default, bf16 = (totals[m, act_order, name] for name in ("best", "default", "bf16"))
        print(f"  M={m} act_order={act_order}: best {best:.1f}, default {default:.1f}, bf16 {bf16:.1f}", end="")
        print(f" -> x{bf16 / best:.2f} vs bf16 (default x{bf16 / default:.2f})")
    print(
        f"# (bits, BLOCK_M, N, K, act order) -> (BLOCK_N, BLOCK_K, warps, K splits, stages), {copy_gbs:.0f} GB/s copy"
    )
    print("TABLE = {\n" + "".join(f"    {key}: {entry},\n" for key, entry in table.items()) + "}")
    print(f"the sweep took {time.perf_counter() - began:.0f} s")


def parse_shape(text: str) -> tuple[int, int]:
    n, _, k = text.partition("x")
    if not (n.isdigit() and k.isdigit()):
        raise argparse.ArgumentTypeError(f"--shapes {text!r}: NxK, e.g. 4096x14336")
    return int(n), int(k)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bits", type=int, default=4, choices=(4, 8))
    parser.add_argument("--group", type=int, default=128, help="input features per scale (divides 4096 and 14336)")
    parser.add_argument("--zero-points", action="store_true", help="asymmetric: a zero point per group")
    parser.add_argument("--codebook", action="store_true", help="bitsandbytes nf4: a 16-value table, 4 bits")
    parser.add_argument("--act-order", action="store_true", help="a random input-feature permutation (desc_act)")
    parser.add_argument("--sweep", action="store_true", help="the tile sweep instead of the table")
    parser.add_argument("--sweep-m", type=int, nargs="+", default=[1, 2, 4], help="batch sizes the sweep covers")
    parser.add_argument("--no-act-order", action="store_true", help="the sweep skips act order (else: at M = 1)")
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=SHAPES, help="the sweep's NxK weights")
    parser.add_argument("--jobs", type=int, default=min(14, os.cpu_count() or 1), help="the sweep's compile processes")
    args = parser.parse_args()
    if args.codebook:
        args.bits, args.zero_points, args.act_order = 4, False, False
    if args.sweep and args.codebook:
        parser.error("--sweep times integer weights (TABLE has no codebook entries)")
    if not torch.cuda.is_available():
        raise SystemExit("wna16_gemv_bench needs a CUDA GPU")
    print(torch.cuda.get_device_name(0), f"bits={args.bits} group={args.group} zero_points={args.zero_points}", end=" ")
    print(f"codebook={args.codebook} act_order={args.act_order}")
    if args.sweep:
        sweep(args)
        return
    check(args)
    layer_summary(table(args))


if __name__ == "__main__":
    main()
