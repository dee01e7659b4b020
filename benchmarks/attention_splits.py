"""Decode attention (KV write + attention) per call at small batches, as a CUDA graph runs it: the split count is the
one a graph captured for max_model_len 8192 picks, and `MIN_TOKENS_PER_SPLIT` is swept (the kernel then uses only the
splits of at least that many keys that a context fills). bfloat16, head dim 128, 32/8 and 16/4 heads.

    python benchmarks/attention_splits.py 64,128,256,512
"""

from __future__ import annotations

import sys

import torch

from pagedllm.attention import triton_backend as tb


def bench(bs: int, keys: int, heads: int, kv_heads: int, min_tokens: int) -> tuple[float, int, float]:
    """(us per call, the graph's split count, max |out - eager out|)."""
    tb.MIN_TOKENS_PER_SPLIT = min_tokens
    dev = torch.device("cuda")
    ctx = keys - 1
    nblk = (keys + 15) // 16
    kv_cache = torch.randn(2, bs * nblk + 1, 16, kv_heads, 128, dtype=torch.bfloat16, device=dev)
    table = torch.arange(bs * nblk, dtype=torch.int32, device=dev).view(bs, nblk)
    seq_lens = torch.full((bs,), keys, dtype=torch.int32, device=dev)
    qsl = torch.arange(bs + 1, dtype=torch.int32, device=dev)
    slots = table[:, ctx // 16].long() * 16 + ctx % 16
    splits = tb.choose_num_splits(bs * kv_heads, 8192, 1, tb.num_sms(dev))
    meta = tb.static_decode_metadata(slots, qsl, seq_lens, table, 16, 8192, splits)
    q = torch.randn(bs, heads, 128, dtype=torch.bfloat16, device=dev)
    k, v = (torch.randn(bs, kv_heads, 128, dtype=torch.bfloat16, device=dev) for _ in range(2))
    ref = tb.forward(q, k, v, kv_cache, meta, 0.088)  # eager: also takes the split counters before the capture
    calls, graph = 20, torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            out = tb.forward(q, k, v, kv_cache, meta, 0.088)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (10 * calls))
    return best, splits, (out.float() - ref.float()).abs().max().item()


def main(argv: list[str]) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("attention_splits.py needs a CUDA GPU")
    minimums = [int(x) for x in (argv[0] if argv else "64,128,256,512").split(",")]
    for heads, kv_heads in ((32, 8), (16, 4)):
        for bs in (1, 4, 16):
            for keys in (128, 384, 640, 1024, 2048, 4096):
                cells = []
                for m in minimums:
                    us, splits, err = bench(bs, keys, heads, kv_heads, m)
                    cells.append(f"min {m}: {us:6.2f} us ({splits} splits, err {err:.2g})")
                print(f"kv_heads={kv_heads} batch={bs:2d} keys={keys:5d}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
