"""`pagedllm run-batch`: OpenAI batch lines in, vLLM's output lines out, each result equal to the offline LLM's;
bad lines are a 400 line, not a crash; killed mid-run and run again, the output holds every request exactly once
(the lines written before the kill kept, a line cut short redone)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from pagedllm.entrypoints.openai.run_batch import done_ids, read_requests

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = [f"Item {i}: the colour of the sky is" for i in range(8)]


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_input_checks_and_torn_output(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(_line("a", "/v1/completions", {"prompt": "x"}) + "\n\n" + _line("a", "/v1/completions", {}) + "\n")
    with pytest.raises(ValueError, match="custom_id 'a' is used twice"):
        read_requests(str(src))
    src.write_text(_line("a", "/v1/files", {}) + "\n")
    with pytest.raises(ValueError, match="url one of"):
        read_requests(str(src))
    src.write_text('{"custom_id": 3}\n')
    with pytest.raises(ValueError, match="string custom_id"):
        read_requests(str(src))
    out = tmp_path / "out.jsonl"
    assert done_ids(str(out)) == set()
    out.write_text('{"custom_id": "a"}\n{"custom_id": "b"}\n{"custom_id": "c", "respo')
    assert done_ids(str(out)) == {"a", "b"}
    assert out.read_text() == '{"custom_id": "a"}\n{"custom_id": "b"}\n'  # the torn line is cut off


def _run(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "pagedllm", "run-batch", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_kill_and_rerun_gives_each_request_once(smollm2, tmp_path):
    from pagedllm import LLM, SamplingParams

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [_line(f"req-{i}", "/v1/completions", {"model": "m", "prompt": p, "max_tokens": 6, "temperature": 0})
             for i, p in enumerate(PROMPTS)]  # fmt: skip
    lines.append(_line("bad", "/v1/completions", {"model": "m", "prompt": "x", "temperature": -1}))
    lines.append(_line("chat", "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                                                        "max_tokens": 3, "temperature": 0}))  # fmt: skip
    src.write_text("\n".join(lines) + "\n")
    args = ["-i", str(src), "-o", str(out), smollm2, "--served-model-name", "m", "--dtype", "float32",
            "--max-model-len", "256", "--kv-cache-memory-bytes", str(16 << 20), "--max-concurrency", "1"]  # fmt: skip
    first = _run(args)
    deadline = time.monotonic() + 300
    while len(_lines(out)) < 3 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait(30)
    before = _lines(out)
    assert 3 <= len(before) < len(lines), "the kill should land mid-run"
    with open(out, "a") as f:
        f.write('{"id": "pagedllm-x", "custom_id": "req-7", "resp')  # a write cut short by the kill
    second = _run(args)
    _, err = second.communicate(timeout=600)
    assert second.returncode == 0, err
    assert f"{len(lines)} requests, {len(before)} already done" in err
    after = _lines(out)
    assert after[: len(before)] == before  # what was written stays as it was
    ids = [line["custom_id"] for line in after]
    assert sorted(ids) == sorted(json.loads(line)["custom_id"] for line in lines)  # each exactly once
    by_id = {line["custom_id"]: line for line in after}
    bad = by_id.pop("bad")
    assert bad["response"]["status_code"] == 400 and bad["error"]["param"] == "temperature"
    assert by_id.pop("chat")["response"]["body"]["object"] == "chat.completion"
    llm = LLM(smollm2, dtype="float32", max_model_len=256, kv_cache_memory_bytes=16 << 20)
    expected = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    for i, o in enumerate(expected):
        line = by_id[f"req-{i}"]
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert line["response"]["body"]["choices"][0]["text"] == o.outputs[0].text
    third = _run(args)  # nothing left: a no-op
    assert third.wait(120) == 0 and _lines(out) == after
