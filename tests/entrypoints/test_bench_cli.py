"""`pagedllm bench latency | throughput` on a tiny model: vLLM's result fields, their values from the run, and the
datasets (random lengths, shared prefix, ShareGPT sampling)."""

from __future__ import annotations

import json
import os
import statistics

import pytest
import transformers
from tiny_models import TINY_DECODER, save_tiny_decoder

from pagedllm.benchmarks.datasets import random_requests, sharegpt_requests
from pagedllm.cli import main

ENGINE = ["--skip-tokenizer-init", "--dtype", "float32", "--kv-cache-memory-bytes", str(1 << 22)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_decoder("bench", transformers.LlamaConfig, transformers.LlamaForCausalLM, TINY_DECODER,
                             tmp_path_factory)[1]  # fmt: skip


def _run(capsys, *argv: str) -> dict:
    assert main(["bench", *argv]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_latency_and_throughput_fields(tiny, capsys, tmp_path):
    out = tmp_path / "latency.json"
    lat = _run(capsys, "latency", "--model", tiny, *ENGINE, "--input-len", "8", "--output-len", "3", "--batch-size",
               "2", "--num-iters-warmup", "0", "--num-iters", "3", "--output-json", str(out))  # fmt: skip
    assert len(lat["latencies"]) == 3 and lat["avg_latency"] == pytest.approx(statistics.fmean(lat["latencies"]))
    assert lat["percentiles"]["50"] == pytest.approx(statistics.median(lat["latencies"]))
    assert sorted(lat["percentiles"]) == sorted(["10", "25", "50", "75", "90", "99"])
    assert json.loads(out.read_text()) == lat
    thr = _run(capsys, "throughput", "--model", tiny, *ENGINE, "--num-prompts", "3", "--input-len", "6",
               "--output-len", "3", "--prefix-len", "2", "--n", "2")  # fmt: skip
    assert thr["num_requests"] == 3 and thr["total_output_tokens"] == 3 * 2 * 3
    assert thr["total_num_tokens"] == 3 * (2 + 6) + 18
    assert thr["requests_per_second"] == pytest.approx(3 / thr["elapsed_time"])
    assert thr["tokens_per_second"] == pytest.approx(thr["total_num_tokens"] / thr["elapsed_time"])


def test_bad_flags_are_errors(tiny, capsys):
    assert main(["bench", "throughput", "--model", tiny, *ENGINE, "--backend", "hf"]) == 2
    assert "--backend='hf' is not supported" in capsys.readouterr().err
    assert main(["bench", "throughput", "--model", tiny, *ENGINE, "--dataset-name", "sharegpt"]) == 2
    assert "needs --dataset-path" in capsys.readouterr().err


class _WordTokenizer:
    def encode(self, text: str) -> list[int]:
        return [len(w) for w in text.split()]


def test_datasets(tmp_path):
    reqs = random_requests(50, 20, 10, 4, range_ratio=0.5, prefix_len=3, seed=1, special_ids={0, 1})
    assert all(8 <= r.prompt_len <= 18 and 2 <= r.output_len <= 6 for r in reqs)
    assert len({tuple(r.prompt[:3]) for r in reqs}) == 1 and all(t > 1 for r in reqs for t in r.prompt)
    assert len({r.prompt_len for r in reqs}) > 1  # the range ratio spreads the lengths
    convs = [
        {"conversations": [{"from": "human", "value": "a b c d e"}, {"from": "gpt", "value": "w x y z"}]},
        {"conversations": [{"from": "human", "value": "too short"}, {"from": "gpt", "value": "p q r s"}]},
        {"conversations": [{"from": "human", "value": "only a question"}]},
    ]
    (tmp_path / "sg.json").write_text(json.dumps(convs))
    reqs = sharegpt_requests(str(tmp_path / "sg.json"), _WordTokenizer(), 5, None, 0)
    assert [(r.prompt, r.prompt_len, r.output_len) for r in reqs] == [("a b c d e", 5, 4)]
    fixed = sharegpt_requests(str(tmp_path / "sg.json"), _WordTokenizer(), 5, 7, 0)
    assert sorted(r.prompt_len for r in fixed) == [2, 5] and {r.output_len for r in fixed} == {7}


def _traces(folder) -> list[str]:
    return [f for f in os.listdir(folder) if f.endswith(".pt.trace.json")]


def test_llm_and_latency_profiles(tiny, capsys, tmp_path, monkeypatch):
    from pagedllm import LLM, SamplingParams

    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    llm = LLM(tiny, skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22)
    with pytest.raises(ValueError, match="VLLM_TORCH_PROFILER_DIR"):
        llm.start_profile()
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "llm"))
    llm.start_profile()
    llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2), use_tqdm=False)
    llm.stop_profile()
    assert len(_traces(tmp_path / "llm")) == 1
    with pytest.raises(ValueError, match="not running"):
        llm.stop_profile()
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "bench"))
    out = _run(capsys, "latency", "--model", tiny, *ENGINE, "--input-len", "4", "--output-len", "2",
               "--batch-size", "1", "--num-iters-warmup", "0", "--profile")  # fmt: skip
    assert out == {"profile": str(tmp_path / "bench")} and len(_traces(tmp_path / "bench")) == 1
