"""Helpers shared by the benchmark scripts: machine description, git commit, JSON line output."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_FILE = BENCH_DIR / "results.jsonl"


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (or platform's guess where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def machine_description() -> dict[str, Any]:
    import torch

    desc: dict[str, Any] = {"cpu": cpu_model(), "cores": usable_cores(), "torch": torch.__version__}
    if torch.cuda.is_available():
        desc["gpu"] = torch.cuda.get_device_name(0)
    return desc


def git_commit() -> str:
    """The short HEAD commit, with '+dirty' when tracked files differ from it; 'unknown' outside git."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()

    try:
        commit = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def make_record(workload: str, machine: dict[str, Any], commit: str, **figures: Any) -> dict[str, Any]:
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return {"date": date, "commit": commit, "machine": machine, "workload": workload, **figures}


def emit(record: dict[str, Any], append: bool = True, path: Path = RESULTS_FILE) -> None:
    """Prints the record as one JSON line on stdout and, with append, adds it to results.jsonl."""
    line = json.dumps(record, sort_keys=False)
    print(line, flush=True)
    if append:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def rounded(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)
