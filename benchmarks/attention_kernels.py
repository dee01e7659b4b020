"""Paged attention on the GPU: the Triton backend's forward against the torch backend's on the same step.

Workloads (Qwen3-0.6B attention shapes by default: 16 query heads, 8 KV heads, head_dim 128, bf16, block 16):
  decode-64x1024   64 decodes over 1024-token contexts (KV read bound: figure is GB/s of K/V read)
  decode-4x8192    4 decodes over 8192-token contexts (split-K's case), with split-K forced off for comparison
  prefill-2048     one 2048-token prefill chunk after 2048 cached tokens (compute bound: figure is TFLOP/s)
Each forward includes the KV-cache write of the step's new tokens; metadata is built once, outside the timing.
Times are CUDA-event medians over --iters after --warmup, of CUDA-graph replays (no Python launch overhead;
eager where capture fails). One JSON line per workload (appended to
benchmarks/results.jsonl unless --no-append).   e.g. python benchmarks/attention_kernels.py --no-append
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch

from pagedllm.attention import torch_backend, triton_backend
from pagedllm.attention.common import BatchLayout

try:
    from benchmarks.common import emit, git_commit, machine_description, make_record, rounded
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    from common import emit, git_commit, machine_description, make_record, rounded


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--no-append", action="store_true", help="do not append to benchmarks/results.jsonl")
    return p.parse_args(argv)


def make_step(reqs, args, dtype=torch.bfloat16):
    """[(context_len, query_len)] -> (q, k, v, kv_cache, layout) on the GPU, blocks given out shuffled."""
    dev, bs = torch.device("cuda"), args.block_size
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
    in the engine, is not counted); eagerly timed where capture fails."""
    for _ in range(warmup):
        fn()
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
    scale = args.head_dim**-0.5
    t_meta = triton_backend.build_metadata(layout)
    t_meta.num_splits = num_splits
    r_meta = torch_backend.build_metadata(layout)
    out_t = triton_backend.forward(q, k, v, kv_cache, t_meta, scale)
    r_cache = torch_backend.from_slot_major(kv_cache)
    out_r = torch_backend.forward(q, k, v, r_cache, r_meta, scale)
    max_err = (out_t.float() - out_r.float()).abs().max().item()
    triton_ms = time_ms(lambda: triton_backend.forward(q, k, v, kv_cache, t_meta, scale), args.iters, args.warmup)
    torch_ms = time_ms(lambda: torch_backend.forward(q, k, v, r_cache, r_meta, scale), args.iters, args.warmup)
    kv_bytes = sum(c + n for c, n in reqs) * args.kv_heads * args.head_dim * 2 * kv_cache.element_size()
    flops = sum(4 * n * (c + (n + 1) / 2) * args.heads * args.head_dim for c, n in reqs)  # causal QK^T + PV
    return dict(
        workload=f"attention-{name}",
        triton_ms=rounded(triton_ms, 4),
        torch_ms=rounded(torch_ms, 4),
        speedup=rounded(torch_ms / triton_ms, 2),
        triton_kv_read_gbps=rounded(kv_bytes / triton_ms / 1e6, 1),
        triton_tflops=rounded(flops / triton_ms / 1e9, 2),
        max_abs_diff=rounded(max_err, 4),
        num_splits="auto" if num_splits is None else num_splits,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    machine, commit = machine_description(), git_commit()
    workloads = [
        ("decode-64x1024", [(1023, 1)] * 64, None),
        ("decode-256x1024", [(1023, 1)] * 256, None),
        ("decode-32x2048", [(2047, 1)] * 32, None),
        ("decode-4x8192", [(8191, 1)] * 4, None),
        ("decode-4x8192-nosplit", [(8191, 1)] * 4, 1),
        ("prefill-2048-after-2048", [(2048, 2048)], None),
        ("mixed-32dec-1prefill512", [(1023, 1)] * 32 + [(0, 512)], None),
    ]
    for name, reqs, splits in workloads:
        fig = run_workload(name, reqs, args, splits)
        shapes = dict(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, block_size=args.block_size)
        emit(make_record(fig.pop("workload"), machine, commit, **fig, **shapes), append=not args.no_append)


if __name__ == "__main__":
    main()
