"""`pagedllm --version` and `pagedllm collect-env` (versions, devices, the pagedllm variables set; no secrets)."""

from __future__ import annotations

import os
import subprocess
import sys

import pagedllm

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _pagedllm(*args: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": REPO, **env}
    return subprocess.run([sys.executable, "-m", "pagedllm", *args], env=full, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_version_and_collect_env():
    assert _pagedllm("--version").stdout.strip() == pagedllm.__version__
    proc = _pagedllm("collect-env", VLLM_API_KEY="hunter2", PAGEDLLM_CPU_KVCACHE_SPACE="2")
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines())
    import torch

    assert lines["pagedllm"] == pagedllm.__version__ and lines["torch"] == torch.__version__
    assert lines["PAGEDLLM_CPU_KVCACHE_SPACE"] == "2" and lines["VLLM_API_KEY"] == "(set)"
    assert "hunter2" not in proc.stdout
