"""VLLM_TORCH_PROFILER_DIR: /start_profile and /stop_profile exist only with it, and a profiled request leaves a
torch trace holding the model's ops in that directory; start twice or stop first is a 400."""

from __future__ import annotations

import json

from conftest import RemoteServer


def test_profile_routes_write_a_trace(smollm2, tmp_path):
    trace_dir = tmp_path / "traces"
    server = RemoteServer(
        [smollm2, "--max-model-len", "256", "--kv-cache-memory-bytes", str(16 << 20)],
        env={"VLLM_TORCH_PROFILER_DIR": str(trace_dir)},
    )
    try:
        server.wait_ready()
        assert server.request("POST", "/stop_profile")[0] == 400  # not running
        assert server.request("POST", "/start_profile")[0] == 200
        assert server.request("POST", "/start_profile")[0] == 400  # already running
        status, _ = server.request("POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
        assert status == 200
        assert server.request("POST", "/stop_profile")[0] == 200
    finally:
        server.stop()
    traces = list(trace_dir.glob("*.pt.trace.json"))
    assert len(traces) == 1
    names = {event.get("name", "") for event in json.loads(traces[0].read_text())["traceEvents"]}
    assert any(name.startswith("aten::") for name in names)


def test_no_profile_routes_without_the_variable(server):
    assert server.request("POST", "/start_profile")[0] == 404
