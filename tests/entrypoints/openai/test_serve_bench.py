"""`pagedllm bench serve` against the shared server: vLLM's result fields, counts that match the requests sent."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import API_KEY, MODEL_NAME

from pagedllm.cli import main


def _bench(capsys, monkeypatch, server, *argv: str) -> dict:
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    assert main(["bench", "serve", "--base-url", server.base_url, *argv]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_random_completions(server, capsys, monkeypatch, tmp_path):
    """The model and its tokenizer come from /v1/models (the card's root)."""
    res = _bench(capsys, monkeypatch, server, "--num-prompts", "4", "--random-input-len", "8", "--random-output-len",
                 "3", "--ignore-eos", "--max-concurrency", "2", "--request-rate", "40", "--metric-percentiles",
                 "50,99", "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json")  # fmt: skip
    assert (res["model_id"], res["completed"], res["failed"]) == (MODEL_NAME, 4, 0)
    assert (res["total_input_tokens"], res["total_output_tokens"]) == (4 * 8, 4 * 3)
    assert res["output_throughput"] == res["total_output_tokens"] / res["duration"]
    for name in ("ttft", "tpot", "itl"):
        assert res[f"p50_{name}_ms"] <= res[f"p99_{name}_ms"] and res[f"mean_{name}_ms"] > 0
    assert "p99_e2el_ms" not in res and res["mean_e2el_ms"] >= res["mean_ttft_ms"]
    assert json.loads((tmp_path / "r.json").read_text()) == res


def test_sharegpt_chat(server, smollm2, capsys, monkeypatch, tmp_path):
    convs = [
        {"conversations": [{"from": "human", "value": f"Tell me about the number {i}."}, {"from": "gpt", "value": "x"}]}
        for i in range(3)
    ]
    (tmp_path / "sg.json").write_text(json.dumps(convs))
    res = _bench(capsys, monkeypatch, server, "--endpoint", "/v1/chat/completions", "--tokenizer", smollm2,
                 "--dataset-name", "sharegpt", "--dataset-path", str(tmp_path / "sg.json"), "--sharegpt-output-len",
                 "2", "--num-prompts", "2", "--ignore-eos", "--save-detailed", "--top-k", "1", "--label", "sg",
                 "--metadata", "gpu=none")  # fmt: skip
    assert (res["completed"], res["total_output_tokens"]) == (2, 4)
    assert res["output_lens"] == [2, 2] and len(res["ttfts"]) == 2 and (res["label"], res["gpu"]) == ("sg", "none")


def test_no_server_is_an_error(capsys):
    assert main(["bench", "serve", "--port", "9", "--num-prompts", "1"]) == 2
    assert "no OpenAI-compatible server answers at http://127.0.0.1:9/v1" in capsys.readouterr().err


def _png_size(path) -> tuple[int, int]:
    """(width, height) of a PNG file, from its signature and IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and data[-8:-4] == b"IEND"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_rates_and_plot(server, capsys, monkeypatch, tmp_path):
    """Several --request-rate values: one run and one result file each; --plot draws them into one PNG, and
    `bench plot` draws the saved files again."""
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    png = tmp_path / "serve.png"
    argv = ["bench", "serve", "--base-url", server.base_url, "--num-prompts", "3", "--random-input-len", "6",
            "--random-output-len", "3", "--ignore-eos", "--request-rate", "50", "inf", "--metric-percentiles",
            "50,99", "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json", "--plot",
            str(png)]  # fmt: skip
    assert main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [r["request_rate"] for r in lines] == [50.0, "inf"] and all(r["completed"] == 3 for r in lines)
    assert _png_size(png) == (1100, 450)
    saved = [tmp_path / "r-50.0qps.json", tmp_path / "r-infqps.json"]
    assert [json.loads(p.read_text()) for p in saved] == lines
    again = tmp_path / "again.png"
    assert main(["bench", "plot", *map(str, saved), "-o", str(again), "--title", "two rates"]) == 0
    assert _png_size(again) == (1100, 450)


def test_plot_without_matplotlib_is_a_clear_error(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert main(["bench", "serve", "--port", "9", "--num-prompts", "1", "--plot", str(tmp_path / "p.png")]) == 2
    assert "--plot needs matplotlib, an optional dependency: pip install 'pagedllm[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()
