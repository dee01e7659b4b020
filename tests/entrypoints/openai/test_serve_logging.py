"""The server's log as vLLM's: the periodic stats line with the rates since the last one, a preemption warning,
request lines unless --disable-log-requests, no stats line with --disable-log-stats."""

from __future__ import annotations

import logging
import re
import time
from types import SimpleNamespace

from conftest import RemoteServer

from pagedllm.entrypoints.openai.server_logging import StatsLogger
from pagedllm.metrics import RequestStats


def _fake_engine():
    kv = SimpleNamespace(num_queries=0, num_hits=0, pool=SimpleNamespace(usage=lambda: 0.25))
    sched = SimpleNamespace(kv=kv, running=[1, 2], waiting=[3], num_preemptions=0)
    return SimpleNamespace(
        output_processor=SimpleNamespace(stats=RequestStats()),
        core=SimpleNamespace(scheduler=sched),
        has_unfinished_requests=lambda: True,
    )


def test_stats_line_gives_the_rates_since_the_last_one(caplog):
    engine = _fake_engine()
    stats = StatsLogger(engine, now=100.0)
    engine.output_processor.stats.prompt_tokens, engine.output_processor.stats.generation_tokens = 50, 20
    engine.core.scheduler.kv.num_queries, engine.core.scheduler.kv.num_hits = 40, 10
    assert stats.line(now=110.0) == (
        "Avg prompt throughput: 5.0 tokens/s, Avg generation throughput: 2.0 tokens/s, Running: 2 reqs, "
        "Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%"
    )
    engine.output_processor.stats.generation_tokens = 30
    engine.core.scheduler.num_preemptions = 3
    with caplog.at_level(logging.WARNING, logger="pagedllm.server"):
        logging.getLogger("pagedllm").propagate = True  # caplog listens on the root logger
        try:
            line = stats.line(now=115.0)
        finally:
            logging.getLogger("pagedllm").propagate = False
    assert "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 2.0 tokens/s" in line
    assert "Prefix cache hit rate: 0.0%" in line
    assert any("3 request(s) preempted" in r.getMessage() and "total 3" in r.getMessage() for r in caplog.records)


def _serve(smollm2, *flags: str) -> RemoteServer:
    server = RemoteServer(
        [smollm2, "--max-model-len", "256", "--kv-cache-memory-bytes", str(16 << 20), *flags],
        env={"VLLM_LOG_STATS_INTERVAL": "0.5"},
    )
    server.wait_ready()
    return server


def test_server_logs_requests_and_stats(smollm2):
    server = _serve(smollm2)
    try:
        status, body = server.request("POST", "/v1/completions", {"prompt": "Hello there", "max_tokens": 3})
        assert status == 200
        time.sleep(1.5)
        log = server.read_log()
    finally:
        server.stop()
    assert re.search(r"INFO .* Received request cmpl-\w+-0: prompt: 'Hello there', params: SamplingParams\(", log)
    assert re.search(r"Finished request cmpl-\w+-0\.", log)
    rates = [float(x) for x in re.findall(r"Avg generation throughput: ([\d.]+) tokens/s", log)]
    assert rates and max(rates) > 0
    assert re.search(r"Running: \d+ reqs, Waiting: \d+ reqs, KV cache usage: [\d.]+%, Prefix cache hit rate", log)


def test_disable_flags_silence_the_lines(smollm2):
    server = _serve(smollm2, "--disable-log-requests", "--disable-log-stats")
    try:
        assert server.request("POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 2})[0] == 200
        time.sleep(1.2)
        log = server.read_log()
    finally:
        server.stop()
    assert "Received request" not in log and "Avg prompt throughput" not in log
