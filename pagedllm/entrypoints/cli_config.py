"""`--config FILE` for the commands (as vLLM's): a YAML (or JSON) mapping of flag names to values, e.g.

    model: /models/llama
    served-model-name: llama
    max_model_len: 4096
    enable-prefix-caching: false

Keys take either spelling (dashes or underscores); true/false become --flag / --no-flag, lists become several
values, mappings JSON. A flag given on the command line wins over the file."""

from __future__ import annotations

import json
from typing import Any


def _load(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json"):
        data = json.loads(text)
    else:
        try:
            import yaml
        except ImportError as e:
            raise ValueError(f"--config {path}: reading YAML needs pyyaml (pip install pyyaml), or give a .json") from e
        data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: the file must hold a mapping of flag names to values")
    return data


def _flag_args(key: str, value: Any) -> list[str]:
    name = key.replace("_", "-")
    if value is None:
        return []
    if value is True:
        return [f"--{name}"]
    if value is False:
        return [f"--no-{name}"]
    if isinstance(value, list):
        return [f"--{name}", *(json.dumps(v) if isinstance(v, (dict, list)) else str(v) for v in value)]
    if isinstance(value, dict):
        return [f"--{name}", json.dumps(value)]
    return [f"--{name}", str(value)]


def _given(argv: list[str]) -> set[str]:
    """Flag names (dashes) the command line gives itself."""
    names = set()
    for arg in argv:
        if arg.startswith("--"):
            name = arg[2:].split("=", 1)[0]
            names.add(name.removeprefix("no-"))
    return names


def bool_values(argv: list[str]) -> list[str]:
    """Flag names with underscores as dashes (`--max_model_len`), and vLLM's older `--enable-prefix-caching=false`
    form of a boolean engine flag as --flag / --no-flag."""
    from dataclasses import fields

    from pagedllm.engine_args import EngineArgs, _flag_type

    booleans = {f.name.replace("_", "-") for f in fields(EngineArgs) if _flag_type(f.type) is bool}
    out = []
    for arg in argv:
        if arg.startswith("--"):  # vLLM also reads --max_model_len: the flag's name with dashes
            name, eq, value = arg[2:].partition("=")
            arg = "--" + name.replace("_", "-") + eq + value
        name, eq, value = arg[2:].partition("=")
        if arg.startswith("--") and eq and name in booleans and value.lower() in ("true", "false"):
            arg = f"--{name}" if value.lower() == "true" else f"--no-{name}"
        out.append(arg)
    return out


def expand_config(argv: list[str]) -> list[str]:
    """argv with `--config FILE` replaced by the file's flags (after the command line's own, minus those it gives),
    and `--flag=true|false` of a boolean engine flag as --flag / --no-flag."""
    argv = bool_values(argv)
    if "--config" not in argv and not any(a.startswith("--config=") for a in argv):
        return argv
    rest, path, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ValueError("--config needs a file")
            path, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    given = _given(rest)
    extra: list[str] = []
    for key, value in _load(path).items():
        if key.replace("_", "-") not in given:
            extra += _flag_args(key, value)
    return rest + extra
