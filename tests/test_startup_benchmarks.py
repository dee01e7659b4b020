"""benchmarks/cold_start.py and benchmarks/prefix_ttft.py on the CPU with a tiny Llama: cold_start starts it twice in
fresh interpreters, one JSON line per run with the start-up split; prefix_ttft times the first tokens of requests
sharing a system prompt with prefix caching off and on. (The GPU runs are the benchmarks' own.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import cold_start, prefix_ttft  # noqa: E402

CPU_ARGS = ["--model-shape", "tiny", "--device", "cpu", "--max-num-seqs", "4", "--kv-cache-memory-bytes", "4194304"]


@pytest.mark.slow
def test_cold_start_prints_one_line_per_run_with_the_split(capsys):
    assert cold_start.main([*CPU_ARGS, "--no-append"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["run"] for r in lines] == ["fresh", "second"]
    for r in lines:
        assert r["workload"] == "cold-start" and r["model_shape"] == "tiny"
        parts = r["import_s"] + r["llm_init_s"] + r["first_token_s"]
        assert r["seconds"] == pytest.approx(parts, abs=0.01)
        assert r["process_s"] >= r["seconds"]
        split = r["split"]
        for phase in ("import", "config", "weights", "compile", "kv_cache", "graph_capture", "engine_other"):
            assert split[phase] >= 0.0
        assert split["total"] <= r["llm_init_s"] + 0.01  # LLM()'s phases, within its wall time
        assert split["import"] <= r["import_s"] + 0.01


def test_cold_start_refuses_a_fresh_run_over_a_filled_cache(tmp_path):
    (tmp_path / "kernel.cubin").write_bytes(b"x")
    with pytest.raises(SystemExit, match="is not empty"):
        cold_start.main([*CPU_ARGS, "--no-append", "--runs", "fresh", "--triton-cache-dir", str(tmp_path)])
    with pytest.raises(SystemExit):
        cold_start.parse_args(["--runs", "warm"])


@pytest.mark.slow
def test_prefix_ttft_reports_both_modes(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(cold_start.TINY), encoding="utf-8")
    argv = ["--model", str(tmp_path), "--load-format", "dummy", "--device", "cpu", "--prefix-tokens", "64",
            "--requests", "4", "--repeats", "1", "--kv-cache-memory-bytes", "4194304", "--no-append"]  # fmt: skip
    assert prefix_ttft.main(argv) == 0
    record = json.loads([line for line in capsys.readouterr().out.splitlines() if line.startswith("{")][-1])
    assert record["workload"] == "prefix-ttft" and record["requests"] == 4
    assert record["cached_prompt_tokens_off"] == 0
    assert record["cached_prompt_tokens_on"] == 4 * 64  # the system prompt's 4 full blocks of 16, per request
    assert record["first_tokens_equal"] is True
    for mode in ("off", "on"):
        assert 0 < record[f"ttft_p50_s_{mode}"] <= record[f"ttft_p99_s_{mode}"] <= record[f"wall_s_{mode}"]
