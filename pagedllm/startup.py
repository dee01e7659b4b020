"""Where the time of `LLM()` goes: named phases (import, config, tokenizer, weights, kernel compile, KV profile, KV
cache, graph capture), timed once each start, logged in one line and kept on the engine for benchmarks."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

_IMPORT_START = time.perf_counter()  # this module is the first that `import pagedllm` runs
IMPORT_SECONDS: float | None = None  # set when `import pagedllm` ends
PHASES = ("import", "config", "tokenizer", "weights", "compile", "kv_profile", "kv_cache", "graph_capture",
          "engine_other", "total")  # fmt: skip


def mark_imported() -> None:
    global IMPORT_SECONDS
    if IMPORT_SECONDS is None:
        IMPORT_SECONDS = time.perf_counter() - _IMPORT_START


class StartupTimer:
    """Seconds per phase, in the order the phases first ran; a phase that runs again adds to its time."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def runner_timer(engine) -> StartupTimer | None:
    """The model runner's timer where it runs in this process (one rank), else None."""
    runner = getattr(getattr(getattr(engine, "core", None), "executor", None), "runner", None)
    return getattr(runner, "startup", None)


def startup_split(timer: StartupTimer, engine) -> dict[str, float]:
    """The phases of one `LLM()`: its own (config, tokenizer), the runner's inside "engine" (weights, compile,
    kv_profile, kv_cache, graph_capture), and engine_other for the rest of the engine's start (scheduler, worker
    processes, ...). "import" (of pagedllm, before `LLM()`) comes first; "total" is the sum without it."""
    split = {"import": IMPORT_SECONDS or 0.0}
    engine_seconds = 0.0
    for name, seconds in timer.seconds.items():
        if name == "engine":
            engine_seconds = seconds
        else:
            split[name] = seconds
    inner = runner_timer(engine)
    runner = dict(inner.seconds) if inner is not None else {}
    split.update(runner)
    split["engine_other"] = max(0.0, engine_seconds - sum(runner.values()))
    split["total"] = sum(v for k, v in split.items() if k != "import")
    rank = {name: i for i, name in enumerate(PHASES)}  # the order they happen in (others after)
    return dict(sorted(split.items(), key=lambda item: rank.get(item[0], len(PHASES))))


def log_split(split: dict[str, float]) -> None:
    parts = ", ".join(f"{k} {v:.2f} s" for k, v in split.items() if k not in ("import", "total"))
    total, imported = split["total"], split["import"]
    logger.info("LLM() started in %.2f s (import pagedllm %.2f s before it): %s", total, imported, parts)
