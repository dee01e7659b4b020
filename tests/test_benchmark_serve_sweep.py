"""benchmarks/serve_sweep.py's pure parts: where p99 TTFT passes 1 s across the swept rates, how many requests a
rate gets, and its flags. (The sweep itself needs a server: its CPU smoke command is in its docstring.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import serve_sweep  # noqa: E402


def rows(*pairs):
    return [{"rate": r, "p99_ttft_ms": t} for r, t in pairs]


def test_ttft_crossing_interpolates_between_the_rates_around_1s():
    assert serve_sweep.ttft_crossing(rows((2, 200.0), (4, 600.0), (8, 1400.0), (16, 9000.0))) == (
        8,
        6.0,
    )  # 4 + 400 / 800 * 4


def test_ttft_crossing_without_a_rate_under_or_over_the_limit():
    assert serve_sweep.ttft_crossing(rows((2, 1200.0), (4, 3000.0))) == (2, None)
    assert serve_sweep.ttft_crossing(rows((2, 100.0), (4, 1000.0))) == (None, None)  # 1 s itself does not pass


@pytest.mark.parametrize(("rate", "expected"), [(0.5, 20), (2, 50), (4, 100), (32, 100)])
def test_prompts_per_rate_are_capped_by_time_and_count(rate, expected):
    args = serve_sweep.parse_args([])  # 100 prompts at most, 25 s per rate, 20 at least
    assert serve_sweep.prompts_for(rate, args) == expected


def test_flags():
    args = serve_sweep.parse_args(["--rates", "1,2.5"])
    assert args.rates == [1.0, 2.5] and args.engine_args == "--max-model-len 4096"
    for bad in ("0,1", "x", ""):
        with pytest.raises(SystemExit):
            serve_sweep.parse_args(["--rates", bad])
    kwargs = serve_sweep.engine_kwargs("--max-model-len 2048 --max-num-batched-tokens 512")
    assert kwargs["max_model_len"] == 2048 and kwargs["max_num_batched_tokens"] == 512


def test_run_benchmark_takes_one_positive_rate():
    from pagedllm.benchmarks.serve import run_benchmark

    for rates in (["1", "2"], ["0"]):
        with pytest.raises(ValueError, match="one positive rate"):
            run_benchmark(["--request-rate", *rates])
