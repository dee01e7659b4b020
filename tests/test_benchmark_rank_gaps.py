"""benchmarks/rank_gaps.py: per-rank device idle and late launches read from profiler traces (a hand-made trace,
and the real traces of a two-rank CPU engine, which have no device work)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import rank_gaps  # noqa: E402


def _trace() -> list[dict]:
    """Kernel a [0, 10), kernel b [12, 20) overlapping c [15, 30), then d [80, 90) launched at 50 by op 'aten::copy_'
    (inside 'step'), and e [95, 100) launched at 40 (early: the device was still busy with d's queue)."""
    k = lambda name, ts, dur, corr: {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}  # noqa: E731
    return [
        k("a", 0, 10, 1), k("b", 12, 8, 2), k("c", 15, 15, 3), k("d", 80, 10, 4), k("e", 95, 5, 5),
        {"cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 50, "dur": 3, "args": {"correlation": 4}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 40, "dur": 3, "args": {"correlation": 5}},
        {"cat": "cpu_op", "name": "step", "ts": 30, "dur": 40},
        {"cat": "cpu_op", "name": "aten::copy_", "ts": 48, "dur": 8},
    ]  # fmt: skip


def test_gaps_merge_overlapping_work():
    span, gaps = rank_gaps.kernel_gaps(_trace())
    assert span == 100
    assert [(g[0], g[2]["name"], g[3]["name"]) for g in gaps] == [(2, "a", "b"), (50, "c", "d"), (5, "d", "e")]


def test_report_names_the_late_launch(tmp_path, capsys):
    (tmp_path / "pagedllm-rank1.1.pt.trace.json").write_text(json.dumps({"traceEvents": _trace()}))
    rows = rank_gaps.report(str(tmp_path), steps=2, top=1)
    assert rows == [{"rank": "pagedllm-rank1", "span_ms": 0.1, "idle_ms": 0.057, "gaps": 3}]
    out = capsys.readouterr().out
    assert "idle after late launches, by host op: aten::copy_ 0.05 ms" in out  # d: launched at 50, work ended at 30
    assert "gap    50.0 us, launched    +20.0 us: c -> d via aten::copy_" in out


def test_report_reads_a_cpu_engines_traces(tmp_path, monkeypatch, capsys):
    """The per-rank traces LLM.start_profile writes for a TP=2 engine on CPUs: read without device work."""
    from tiny_models import TINY_DECODER, save_tiny_decoder
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedllm import LLM, SamplingParams

    class Factory:
        def mktemp(self, name):
            path = tmp_path / name
            path.mkdir()
            return path

    _, model = save_tiny_decoder("rank-gaps", LlamaConfig, LlamaForCausalLM, TINY_DECODER, Factory())
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "traces"))
    llm = LLM(model, tensor_parallel_size=2, dtype="float32", skip_tokenizer_init=True, block_size=4)
    try:
        llm.start_profile()
        llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2), use_tqdm=False)
        llm.stop_profile()
    finally:
        llm.llm_engine.shutdown()
    rows = rank_gaps.report(str(tmp_path / "traces"), steps=2, top=3)
    assert [r["rank"] for r in rows] == ["pagedllm-rank0", "pagedllm-rank1"]
    assert all(r["span_ms"] == 0 and r["gaps"] == 0 for r in rows)
