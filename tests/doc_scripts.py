"""Runs a script written against vLLM (as its documents and examples show it) with only the names changed: `vllm`
-> `pagedllm` in the imports, and quoted names (hub models, file paths, URLs) -> local ones."""

from __future__ import annotations

import contextlib
import io
import re
import sys


def as_pagedllm(script: str, names: dict[str, str]) -> str:
    """The only changes: `vllm` -> `pagedllm` in the imports, each quoted name -> its local value."""
    script = re.sub(r"^(\s*)from vllm([. ])", r"\1from pagedllm\2", script, flags=re.M)
    for name, local in names.items():
        script = script.replace(f'"{name}"', repr(local))
    return script


def run_script(script: str, names: dict[str, str], argv: list[str] | None = None, namespace: dict | None = None) -> str:
    """Runs the changed script as __main__ (in `namespace`, where the test can read its variables afterwards);
    returns what it printed."""
    code = as_pagedllm(script, names)
    assert "vllm" not in code.replace("pagedllm", "")
    out, saved = io.StringIO(), sys.argv
    if namespace is not None:
        namespace["__name__"] = "__main__"
    sys.argv = ["example.py", *(argv or [])]
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, "example.py", "exec"), namespace if namespace is not None else {"__name__": "__main__"})
    finally:
        sys.argv = saved
    return out.getvalue()
