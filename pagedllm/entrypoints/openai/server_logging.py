"""The server's log lines, as vLLM writes them: the periodic stats line (prompt and generation throughput, running
and waiting requests, KV-cache usage, prefix-cache hit rate, every VLLM_LOG_STATS_INTERVAL seconds; off with
--disable-log-stats), a warning when requests were preempted, and one line per request received, finished or
aborted (off with --disable-log-requests)."""

from __future__ import annotations

import logging
import threading
import time

from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm.server")


class RequestLogger:
    def __init__(self, max_log_len: int | None = None) -> None:
        self.max_log_len = max_log_len

    def received(self, request_id: str, prompt: str | None, token_ids: list[int], params: SamplingParams) -> None:
        if self.max_log_len is not None:
            prompt = prompt[: self.max_log_len] if prompt is not None else None
            token_ids = token_ids[: self.max_log_len]
        logger.info(
            "Received request %s: prompt: %r, params: %s, prompt_token_ids: %s", request_id, prompt, params, token_ids
        )

    def finished(self, request_id: str) -> None:
        logger.info("Finished request %s.", request_id)

    def aborted(self, request_ids: list[str]) -> None:
        logger.info("Aborted request(s) %s.", ", ".join(request_ids))


class StatsLogger:
    """Reads the engine's counters (as /metrics does: each read whole, from another thread) and logs the rates
    since the last line."""

    def __init__(self, engine, now: float | None = None) -> None:
        self.engine = engine
        self.last = self._counters(time.monotonic() if now is None else now)
        self.was_idle = False

    def _counters(self, now: float) -> dict[str, float]:
        stats, sched = self.engine.output_processor.stats, self.engine.core.scheduler
        return {
            "time": now,
            "prompt": stats.prompt_tokens,
            "generation": stats.generation_tokens,
            "queries": sched.kv.num_queries,
            "hits": sched.kv.num_hits,
            "preemptions": sched.num_preemptions,
        }

    def line(self, now: float | None = None) -> str:
        """The stats line since the last call (and logs the preemption warning, if any)."""
        current = self._counters(time.monotonic() if now is None else now)
        delta = {k: current[k] - self.last[k] for k in current}
        self.last = current
        elapsed = max(delta["time"], 1e-9)
        sched = self.engine.core.scheduler
        if delta["preemptions"]:
            logger.warning(
                "%d request(s) preempted (recomputed later) for lack of KV-cache space; total %d. This can affect "
                "end-to-end latency: give the cache more memory (kv_cache_memory_bytes, gpu_memory_utilization).",
                delta["preemptions"], current["preemptions"],
            )  # fmt: skip
        hit_rate = 100.0 * delta["hits"] / delta["queries"] if delta["queries"] else 0.0
        return (
            f"Avg prompt throughput: {delta['prompt'] / elapsed:.1f} tokens/s, Avg generation throughput: "
            f"{delta['generation'] / elapsed:.1f} tokens/s, Running: {len(sched.running)} reqs, Waiting: "
            f"{len(sched.waiting)} reqs, KV cache usage: {100.0 * sched.kv.pool.usage():.1f}%, Prefix cache hit "
            f"rate: {hit_rate:.1f}%"
        )

    def log(self) -> None:
        before = (self.last["prompt"], self.last["generation"])
        text = self.line()
        idle = before == (self.last["prompt"], self.last["generation"]) and not self.engine.has_unfinished_requests()
        # an idle server logs its line once, then only at debug level until work comes (as vLLM)
        logger.log(logging.DEBUG if idle and self.was_idle else logging.INFO, text)
        self.was_idle = idle


def start_stats_thread(engine, interval: float) -> threading.Event:
    """Logs the stats line every `interval` seconds from a daemon thread until the returned event is set."""
    stop = threading.Event()
    stats = StatsLogger(engine)

    def run() -> None:
        while not stop.wait(interval):
            stats.log()

    threading.Thread(target=run, name="pagedllm-stats", daemon=True).start()
    return stop
