"""vLLM's `cleanup_dist_env_and_memory()`, which scripts call between two LLMs: importable from
pagedllm.distributed and harmless to call (with or without a Ray connection to end)."""

from __future__ import annotations

import gc

from pagedllm.distributed import cleanup_dist_env_and_memory


def test_cleanup_collects_garbage_and_can_be_called_twice(monkeypatch):
    calls = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("gc") or 0)
    cleanup_dist_env_and_memory()
    cleanup_dist_env_and_memory(shutdown_ray=True)
    assert calls == ["gc", "gc"]
