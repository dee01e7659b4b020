"""benchmarks/attention_kernels.py runs end to end on tiny shapes (--shrink) in Triton's interpreter (the patches of
tests/kernels/conftest.py make it run on CPU): one JSON line per workload, Triton's output matching the torch
backend's, and the at-its-limit workloads carrying their goals and figures."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import attention_kernels  # noqa: E402


@pytest.mark.slow
def test_every_workload_prints_a_line(capsys):
    names = [
        "decode-4x8192-nosplit", "limit-decode-32x8192", "limit-decode-1x131072", "limit-prefill-8192",
        "tp2-decode-256-mixed-split4",
    ]  # fmt: skip
    attention_kernels.main(
        ["--shrink", "512", "--iters", "1", "--warmup", "0", "--no-append", "--workloads", ",".join(names)]
    )
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["workload"] for r in lines] == [f"attention-{n}" for n in names]
    for r in lines:
        assert r["max_abs_diff"] < 0.05 and r["triton_ms"] > 0 and r["shrink"] == 512
    nosplit, dec8k, dec128k, prefill, mixed = lines
    assert mixed["num_splits"] == 4 and (mixed["heads"], mixed["kv_heads"]) == (16, 4)
    assert nosplit["num_splits"] == 1 and (nosplit["heads"], nosplit["kv_heads"]) == (16, 8)
    assert (dec128k["heads"], dec128k["kv_heads"], dec128k["head_dim"]) == (32, 8, 128)
    # 1 x 128k shrunk 512: 131071 // 512 = 255 context tokens + the new one, K and V of 8 heads x 128 dims in bf16
    assert dec128k["kv_bytes"] == 256 * 8 * 128 * 2 * 2
    assert dec8k["goal"] == 0.85 and "kv_read_frac_of_copy" in dec8k
    # the 8k prefill shrunk 512: 16 tokens, 16 * 17 / 2 causal pairs, 4 * heads * head_dim FLOPs each
    assert prefill["flops"] == 4 * 32 * 128 * 16 * 17 // 2 and prefill["goal"] == 0.5


@pytest.mark.slow
def test_fp8_cache_workloads(capsys):
    """--kv-cache-dtype fp8: an E4M3 cache, its bytes counted one a value, the reference over the same values."""
    attention_kernels.main(
        ["--shrink", "512", "--iters", "1", "--warmup", "0", "--no-append", "--workloads", "limit-decode-1x131072",
         "--kv-cache-dtype", "fp8"]
    )  # fmt: skip
    (r,) = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert r["workload"] == "attention-limit-decode-1x131072-fp8-cache"
    assert r["kv_bytes"] == 256 * 8 * 128 * 2 and r["max_abs_diff"] < 0.05


@pytest.mark.slow
def test_sweep_prints_each_config_and_the_best(capsys, monkeypatch):
    """--sweep: one line per config (the default's first), the fastest as a PREFILL_TILES line, one JSON summary
    per workload; PREFILL_TILES is left as it was."""
    from pagedllm.attention import triton_backend

    monkeypatch.setattr(attention_kernels, "SWEEP_WORKLOADS", ("limit-prefill-8192",))
    monkeypatch.setattr(attention_kernels, "SWEEP_GRID", [(64, 32, 4, 2), (128, 16, 8, 3)])
    before = dict(triton_backend.PREFILL_TILES)
    attention_kernels.main(["--sweep", "--shrink", "256", "--iters", "1", "--warmup", "0", "--no-append"])
    out = capsys.readouterr().out.splitlines()
    assert triton_backend.PREFILL_TILES == before
    sweep = [line for line in out if line.startswith("# sweep limit-prefill-8192")]
    assert len(sweep) == 3 and "default" in sweep[0]
    assert "rows=64 (BLOCK_Q=16) BLOCK_N=32 warps=4 stages=2" in sweep[1]
    assert "rows=128 (BLOCK_Q=32) BLOCK_N=16 warps=8 stages=3" in sweep[2]
    best = [line for line in out if line.startswith("# best for limit-prefill-8192: PREFILL_TILES = {128: (")]
    assert len(best) == 1
    (record,) = [json.loads(line) for line in out if line.startswith("{")]
    assert record["workload"] == "attention-sweep-limit-prefill-8192" and record["configs_timed"] == 2
    assert tuple(record["best_config"]) in [(64, 32, 4, 2), (128, 16, 8, 3)] and record["best_max_abs_diff"] < 0.05
    # the 8k prefill shrunk 256: 32 tokens
    assert record["heads"] == 32 and record["default_ms"] > 0 and record["configs_skipped"] == 0


@pytest.mark.slow
def test_fusion_bench_prints_identical_sides(capsys):
    """benchmarks/decode_attention_fusion.py: one line per workload, the fused and unfused launches giving the same
    bits (output and cache), with and without the per-head q/k norm."""
    from benchmarks import decode_attention_fusion

    for extra in ([], ["--qk-norm"]):
        decode_attention_fusion.main(["--shrink", "64", "--iters", "1", "--warmup", "0", "--no-append", *extra])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["workload"] for r in lines] == [f"attention-fusion-{n}" for n in decode_attention_fusion.WORKLOADS] * 2
    assert all(r["identical"] and r["fused_us"] > 0 and r["unfused_us"] > 0 for r in lines)
    assert [r["qk_norm"] for r in lines] == [False] * 3 + [True] * 3
