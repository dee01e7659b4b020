"""Paged attention on the CPU: the torch backend's C kernels against its torch-op path on the same steps.

Workloads (SmolLM2-135M's attention by default: 9 query heads, 3 KV heads, head_dim 64, bfloat16, block 16):
  cpu-decode-64xL      64 decodes over L-token contexts (--contexts, default 40 and 160), one step through --layers
                       caches (30 by default, so that they do not fit the CPU's caches, as in a model's step);
                       blocks spread as the engine hands them out (each request's next block after the others')
  cpu-prefill-Nx64     N prefill chunks of 64 tokens (--prefill-tokens in all, default 2048), one layer: the
                       default routing (chunks of up to PAGED_PREFILL_LEN tokens as paged rows in the C kernel)
                       against one SDPA call per chunk (paged_prefill_len=0)
Each forward includes the cache write of the step's new tokens; a step builds its attention metadata once. Times are the
best of --repeats. One JSON line per workload (appended to benchmarks/results.jsonl unless --no-append).

    python benchmarks/cpu_attention.py --no-append
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from pagedllm.attention import torch_backend
from pagedllm.attention.common import BatchLayout
from pagedllm.kernels import cpu_kernels

try:
    from benchmarks.common import emit, git_commit, machine_description, make_record, rounded, usable_cores
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    from common import emit, git_commit, machine_description, make_record, rounded, usable_cores


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--contexts", default="40,160", help="decode context lengths (default 40,160)")
    p.add_argument("--layers", type=int, default=30, help="caches a decode step goes through (default 30)")
    p.add_argument("--prefill-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=usable_cores())
    p.add_argument("--no-append", action="store_true", help="do not append to benchmarks/results.jsonl")
    return p.parse_args(argv)


def step(args: argparse.Namespace, query_lens: list[int], context: int, gen: torch.Generator):
    """q/k/v of one step and its layout: each request has `context` cached tokens and query_lens[i] new ones; the
    blocks are handed out round-robin over the requests, as a growing batch takes them."""
    bs, n = args.block_size, len(query_lens)
    blocks_per = [-(-(context + q) // bs) for q in query_lens]
    table = np.zeros((n, max(blocks_per)), dtype=np.int64)
    next_id = 0
    for b in range(max(blocks_per)):
        for i in range(n):
            if b < blocks_per[i]:
                table[i, b], next_id = next_id, next_id + 1
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int64)
    seq_lens = np.array([context + q for q in query_lens], dtype=np.int64)
    slots = np.concatenate(
        [table[i, pos // bs] * bs + pos % bs for i, pos in enumerate(np.arange(context, s) for s in seq_lens)]
    )
    layout = BatchLayout(qsl, seq_lens, table, torch.from_numpy(slots), bs, torch.device("cpu"))
    tokens, h, kvh, d = int(qsl[-1]), args.heads, args.kv_heads, args.head_dim
    q = torch.randn(tokens, h, d, generator=gen).to(torch.bfloat16)
    k = torch.randn(tokens, kvh, d, generator=gen).to(torch.bfloat16)
    v = torch.randn(tokens, kvh, d, generator=gen).to(torch.bfloat16)
    return q, k, v, layout, next_id


def caches(args: argparse.Namespace, count: int, num_blocks: int, gen: torch.Generator) -> list[torch.Tensor]:
    out = []
    for _ in range(count):
        cache = torch_backend.allocate_kv_cache(
            num_blocks, args.block_size, args.kv_heads, args.head_dim, torch.bfloat16, torch.device("cpu")
        )
        cache.copy_(torch.randn(cache.shape, generator=gen))
        out.append(cache)
    return out


def best_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def decode(args, context: int, gen: torch.Generator, c_path: bool) -> float:
    q, k, v, layout, num_blocks = step(args, [1] * args.requests, context - 1, gen)
    layers = caches(args, args.layers, num_blocks, gen)
    scale = args.head_dim**-0.5
    supports = cpu_kernels.supports

    def run() -> None:  # one step: its metadata once, then every layer
        meta = torch_backend.build_metadata(layout)
        for cache in layers:
            torch_backend.forward(q, k, v, cache, meta, scale)

    try:
        if not c_path:
            cpu_kernels.supports = lambda *a: False
        return best_ms(run, args.repeats)
    finally:
        cpu_kernels.supports = supports


def prefill(args, gen: torch.Generator, paged_prefill_len: int | None) -> float:
    chunks = args.prefill_tokens // 64
    q, k, v, layout, num_blocks = step(args, [64] * chunks, 0, gen)
    (cache,) = caches(args, 1, num_blocks, gen)
    scale = args.head_dim**-0.5
    return best_ms(
        lambda: torch_backend.forward(q, k, v, cache, torch_backend.build_metadata(layout, paged_prefill_len), scale),
        args.repeats,
    )


@torch.inference_mode()
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if cpu_kernels.compiled() is None:
        raise SystemExit("the C kernels did not build (no C compiler?): nothing to compare")
    gen = torch.Generator().manual_seed(0)
    machine, commit = machine_description(), git_commit()
    config = {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "threads": args.threads}
    for context in (int(c) for c in args.contexts.split(",")):
        c_ms, torch_ms = decode(args, context, gen, True), decode(args, context, gen, False)
        kv_gb = args.layers * args.requests * context * args.kv_heads * args.head_dim * 2 * 2 / 1e9
        record = make_record(
            f"cpu-decode-{args.requests}x{context}", machine, commit,
            c_kernel_ms=rounded(c_ms, 3), torch_ops_ms=rounded(torch_ms, 3), speedup=rounded(torch_ms / c_ms, 3),
            c_kernel_kv_gb_s=rounded(kv_gb / c_ms * 1e3, 2), layers=args.layers, **config,
        )  # fmt: skip
        emit(record, append=not args.no_append)
    paged_ms, sdpa_ms = prefill(args, gen, None), prefill(args, gen, 0)
    record = make_record(
        f"cpu-prefill-{args.prefill_tokens // 64}x64", machine, commit,
        paged_rows_ms=rounded(paged_ms, 3), sdpa_per_chunk_ms=rounded(sdpa_ms, 3),
        speedup=rounded(sdpa_ms / paged_ms, 3), paged_prefill_len=torch_backend.PAGED_PREFILL_LEN, **config,
    )  # fmt: skip
    emit(record, append=not args.no_append)


if __name__ == "__main__":
    main()
