"""`pagedllm collect-env`: the facts a bug report needs (as `vllm collect-env`): versions of pagedllm, Python,
torch and the libraries it uses, the OS and CPU, the GPUs torch sees, and the environment variables pagedllm reads."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys

LIBRARIES = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "gguf", "triton", "xgrammar", "fastapi",
             "uvicorn", "pydantic", "openai")  # fmt: skip


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def collect() -> dict[str, str]:
    import torch

    from pagedllm import __version__, envs

    info = {
        "pagedllm": __version__,
        "Python": sys.version.split()[0],
        "OS": platform.platform(),
        "CPU": f"{platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
    }
    info |= {lib: _version(lib) for lib in LIBRARIES}
    info["CUDA (torch build)"] = str(torch.version.cuda)
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpus = [torch.cuda.get_device_name(i) for i in range(num_gpus)]
    info["GPUs"] = ", ".join(gpus) or "none"
    for name in envs.ENV_VARS:
        found = envs.get(name)
        if found is not None:
            info[found[0]] = "(set)" if name.endswith(("API_KEY", "TOKEN")) else found[1]  # never print a secret
    return info


def _collect_env(_: argparse.Namespace) -> int:
    for key, value in collect().items():
        print(f"{key}: {value}")
    return 0


def add_collect_env_parser(sub) -> None:
    sub.add_parser("collect-env", help="print versions and settings for a bug report").set_defaults(func=_collect_env)
