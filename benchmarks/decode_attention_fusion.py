"""One decoder layer's attention launches at decode, unfused against fused (Llama-3.1-8B shapes: 32 query heads,
8 KV heads, head_dim 128, bf16, block 16):
  unfused  fused_ops.qk_rotary, then the Triton backend's forward (write_kv, attention, reduce_splits_kernel when
           split-K is on)
  fused    forward(..., rope=): rotary_write_kv (rotary + cache write in one launch), attention whose last programs
           merge the splits (no reduce launch)
Workloads: batch 1 and 64 over 1k-token contexts, batch 1 over 8k (split-K's case); --qk-norm adds Qwen3's per-head
q/k RMSNorm to both sides. Both sides must give the same bits (output and cache): `identical`. Times are CUDA-graph
replay medians (benchmarks/attention_kernels.time_ms); one JSON line per workload (appended to
benchmarks/results.jsonl unless --no-append). Without CUDA the kernels run in Triton's interpreter (smoke runs:
--shrink divides contexts and batches).
    python benchmarks/decode_attention_fusion.py --no-append
"""

from __future__ import annotations

import argparse
import os

import torch

if not torch.cuda.is_available():  # read when the kernels are decorated, so before pagedllm.attention's import
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagedllm.attention import triton_backend  # noqa: E402
from pagedllm.kernels.fused_ops import qk_rotary  # noqa: E402
from pagedllm.layers.rotary_embedding import RotaryEmbedding  # noqa: E402

try:
    from benchmarks.attention_kernels import make_step, shrunk, time_ms
    from benchmarks.common import emit, git_commit, machine_description, make_record, rounded
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    from attention_kernels import make_step, shrunk, time_ms
    from common import emit, git_commit, machine_description, make_record, rounded

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
WORKLOADS = {  # name -> [(context_len, query_len)] per request
    "decode-1x1024": [(1023, 1)],
    "decode-64x1024": [(1023, 1)] * 64,
    "decode-1x8192": [(8191, 1)],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--qk-norm", action="store_true", help="per-head q/k RMSNorm before the rotary (Qwen3)")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--shrink", type=int, default=1, help="divide context lengths and batch sizes (smoke runs)")
    p.add_argument("--no-append", action="store_true", help="do not append to benchmarks/results.jsonl")
    return p.parse_args(argv)


@torch.inference_mode()
def run_workload(reqs, args) -> dict:
    q, k, v, cache, layout = make_step(reqs, args)
    n, scale = q.shape[0], args.head_dim**-0.5
    rope = RotaryEmbedding(args.head_dim, 16384, 500_000.0, None).to(DEVICE)
    cos_sin = rope(torch.tensor([c + m - 1 for c, m in reqs], device=DEVICE), q.dtype)
    norm = None
    if args.qk_norm:
        weights = [1 + 0.1 * torch.randn(args.head_dim, device=DEVICE, dtype=q.dtype) for _ in range(2)]
        norm = (*weights, 1e-6)
    meta = triton_backend.build_metadata(layout)
    unfused_cache, fused_cache = cache, cache.clone()

    def unfused():
        triton_backend.SPLIT_IN_KERNEL = False
        rq, rk = qk_rotary(q, k, *cos_sin, norm[:2] if norm else None, norm[2] if norm else 1e-6)
        return triton_backend.forward(rq, rk, v, unfused_cache, meta, scale)

    def fused():
        triton_backend.SPLIT_IN_KERNEL = True
        return triton_backend.forward(q, k, v, fused_cache, meta, scale, rope=cos_sin, qk_norm=norm)

    saved = triton_backend.SPLIT_IN_KERNEL
    try:
        identical = torch.equal(unfused(), fused()) and torch.equal(unfused_cache, fused_cache)
        unfused_ms = time_ms(unfused, args.iters, args.warmup)  # (one graph each: the flag is read at capture)
        fused_ms = time_ms(fused, args.iters, args.warmup)
    finally:
        triton_backend.SPLIT_IN_KERNEL = saved
    splits = triton_backend.choose_num_splits(
        n * args.kv_heads, meta.max_seq_len, 1, triton_backend.num_sms(DEVICE)
    )  # fmt: skip
    return dict(
        unfused_us=rounded(1e3 * unfused_ms, 2),
        fused_us=rounded(1e3 * fused_ms, 2),
        saved_us=rounded(1e3 * (unfused_ms - fused_ms), 2),
        identical=identical,
        num_splits=splits,
        batch=len(reqs),
        context=reqs[0][0] + 1,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    machine, commit = machine_description(), git_commit()
    for name, reqs in WORKLOADS.items():
        fig = run_workload(shrunk(reqs, args.shrink), args)
        params = dict(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, qk_norm=args.qk_norm)
        record = make_record(f"attention-fusion-{name}", machine, commit, **fig, **params, shrink=args.shrink)
        emit(record, append=not args.no_append)


if __name__ == "__main__":
    main()
