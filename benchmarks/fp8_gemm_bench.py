"""FP8 linears at mid-sized batches on the GPU, Llama-3.1-8B's four layer shapes: the row-wise scaled Triton GEMM
of fp8_gemm.py (every SWEEP tile, with 1, 2 and 4 programs wanted per SM before K stops being split) against
cuBLASLt's (torch._scaled_mm) and the bf16 F.linear, on the same pre-quantized activations. Each op is captured
CALLS times into a CUDA graph cycling over enough weight copies to miss the L2 cache (fp8_gemv_bench's timing);
printed per batch and shape, then per batch the four shapes' summed time of each, the best tile, and the winners
(at least 3% faster than cuBLASLt) as literals for fp8_gemm.py: TABLE (a layer's four on one tile, power-of-two
batches) and SHAPE_TABLE (per rows key and shape; a key left out keeps cuBLASLt). Every tile is checked against
torch._scaled_mm first. The default batches are the CUDA graphs' sizes from 32 to 256 rows, then 512 and 1024.

    PYTHONPATH=. python benchmarks/fp8_gemm_bench.py [--batches 32 64 128 256 512 1024]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from fp8_gemv_bench import L2_MISS_BYTES, sweep_us

from pagedllm.layers.quantization import fp8_gemm

SHAPES = fp8_gemm.MEASURED_SHAPES  # (N, K): qkv, o, gate_up, down
WIN = 0.97


def shape_ops(m: int, n: int, k: int) -> dict:
    """name or tile config -> callables over weight copies, each tile checked against torch._scaled_mm first."""
    dev = torch.device("cuda")
    copies = max(1, -(-L2_MISS_BYTES // (n * k)))
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    xq = (x.float() * 30).clamp(-448, 448).to(torch.float8_e4m3fn)
    xs = torch.rand(m, 1, device=dev) / 100 + 1e-3
    w8 = [(torch.randn(n, k, device=dev) * 50).to(torch.float8_e4m3fn) for _ in range(copies)]
    ws = torch.rand(n, device=dev) / 100 + 1e-3
    w16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(-(-copies // 2))]
    scale_b = ws.reshape(1, n)

    def cublas(w):
        return lambda: torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=scale_b, out_dtype=torch.bfloat16)

    def triton_mm(w, cfg):
        return lambda: fp8_gemm.fp8_rowwise_mm(xq, xs, w, ws, torch.bfloat16, cfg)

    want = cublas(w8[0])().float()
    ops = {"cublas": [cublas(w) for w in w8], "bf16": [lambda w=w: F.linear(x, w) for w in w16]}
    for tile in fp8_gemm.SWEEP:
        for per_sm in (1, 2, 4):
            cfg = (*tile, per_sm)
            got = triton_mm(w8[0], cfg)().float()
            torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7 * want.abs().max().item())
            ops[cfg] = [triton_mm(w, cfg) for w in w8]
    return ops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[*range(32, 257, 16), 512, 1024])
    args = p.parse_args()
    print(torch.cuda.get_device_name())
    table, shape_table = {}, {}
    for m in args.batches:
        totals = {"cublas": 0.0, "bf16": 0.0}
        best_sum = 0.0  # each shape on its fastest op (cuBLASLt or a tile)
        for n, k in SHAPES:
            times = {name: sweep_us(fns) for name, fns in shape_ops(m, n, k).items()}
            torch.cuda.empty_cache()
            for name, t in times.items():
                totals[name] = totals.get(name, 0.0) + t
            tile = min((c for c in times if isinstance(c, tuple)), key=times.get)
            print(
                f"  M={m:5d} N={n:5d} K={k:5d}: cublas {times['cublas']:7.1f} us  bf16 {times['bf16']:7.1f}  "
                f"triton best {times[tile]:7.1f} {tile} = {times[tile] / times['cublas']:.3f} of cublas"
            )
            best_sum += min(times[tile], times["cublas"])
            if times[tile] < WIN * times["cublas"]:
                shape_table[(fp8_gemm.rows_key(m), n, k)] = tile
        best = min((c for c in totals if isinstance(c, tuple)), key=totals.get)
        ratio = totals[best] / totals["cublas"]
        print(
            f"M={m:5d}: cublas {totals['cublas']:8.1f} us  bf16 {totals['bf16']:8.1f} us  "
            f"triton best {totals[best]:8.1f} us {best}  = {ratio:.3f} of cublas; each shape's best {best_sum:8.1f} us"
        )
        if ratio < WIN and fp8_gemm.bucket(m) == m:
            table[m] = best
    print("TABLE =", table)
    print("SHAPE_TABLE = {")
    for key, tile in shape_table.items():
        print(f"    {key}: {tile},")
    print("}")


if __name__ == "__main__":
    main()
